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


def test_a_long_state_download_and_the_nodes_reachability_each_get_one_line() -> None:
    from dataclasses import asdict

    from dht.transfer_progress import ProgressReport

    report = ProgressReport(peer_id="12D3KooWdonor", num_bytes=12_300_000, total_bytes=50_000_000,
                            bytes_per_s=1_200_000.0, eta_s=31.4, elapsed_s=10.0)  # fmt: skip
    assert _console_lines("state_progress", line=report.line(), **asdict(report)) == [
        "downloading the replica from 12D3KooWdonor: 12.3 of 50.0 MB (25 %), 1.20 MB/s, 31 s left"
    ]
    line = "behind a NAT, reachable through relay 12D3KooWrelay"
    assert _console_lines("reachability", line=line, relays=[], maddrs=[]) == [
        f"reachability: {line}"
    ]
