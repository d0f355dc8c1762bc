"""What the human console prints of a node's events (issue 24): the line seen, or none."""

from __future__ import annotations

import io
import json

from rich.console import Console

from node.events import ConsoleEventLog, JsonEventLog


def _console_lines(event: str, **fields: object) -> list[str]:
    out = io.StringIO()
    ConsoleEventLog(Console(file=out, width=200)).emit(event, **fields)
    return out.getvalue().splitlines()


def test_background_saves_stay_off_the_console_but_in_the_json_log() -> None:
    saved = {"path": "/ckpt/checkpoint.json", "round": 3, "step": 40}
    assert _console_lines("checkpoint_saved", **saved, background=True) == []
    assert _console_lines("checkpoint_saved", **saved, background=False) == [
        "checkpoint saved to /ckpt/checkpoint.json (round 4 kept at step 40)"
    ]
    out = io.StringIO()
    JsonEventLog(out).emit("checkpoint_saved", **saved, background=True)
    assert json.loads(out.getvalue())["background"] is True
