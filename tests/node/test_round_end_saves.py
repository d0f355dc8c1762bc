"""The end of a round's checkpoint is written beside training (issue 23): the next round's
steps do not wait for the write, what lands is the state as the round ended, the file left on
disk at the stop is the last state, and a write that fails stops the node (one save later)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from node import persistence
from node.checkpoint import load_checkpoint
from node.events import RecordingEventLog
from node.runtime import Node
from tests.node.test_partial_saves import _config

WRITE_S = 0.5
"""A slow disk: each write takes at least this long."""


class StepsRecorded(RecordingEventLog):
    """Records every inner step as a `step` event, in order with the others."""

    def progress(self, **fields: Any) -> None:
        self.emit("step", round=fields["round"], step=fields["step"])


def _slow_writes(monkeypatch: pytest.MonkeyPatch, written: list[dict[str, Any]]) -> None:
    real = persistence.save_checkpoint

    def slow(directory: Path, state: dict[str, Any], layout: Any) -> Path:
        threading.Event().wait(WRITE_S)
        written.append(state)
        return real(directory, state, layout)

    monkeypatch.setattr(persistence, "save_checkpoint", slow)


def test_the_next_round_steps_while_the_last_one_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[dict[str, Any]] = []
    _slow_writes(monkeypatch, written)
    monkeypatch.setattr(persistence, "PARTIAL_SAVE_MIN_S", 1e3)  # end-of-round saves only
    monkeypatch.setattr(persistence, "PARTIAL_SAVE_S", 1e3)
    events = StepsRecorded()
    node = Node(_config(tmp_path, checkpoint_every=1, max_rounds=3), events)
    node.run()

    order = [(e["event"], e.get("round")) for e in events.events]
    saved = events.of("checkpoint_saved")
    # Each round's end, then the stop's (on the training thread, after those).
    assert [(e["round"], e["background"]) for e in saved] == [(r, False) for r in (1, 2, 3, 3)]
    # Round 2's first step came before round 1's save was on disk: it did not wait for it.
    assert order.index(("step", 2)) < order.index(("checkpoint_saved", 1))
    # What was written is each round as it ended, not what the learner did after it.
    assert [(s["round"], s["learner"]["step"]) for s in written[:3]] == [(1, 5), (2, 10), (3, 15)]
    assert all(s["partial_round"] is None for s in written)
    assert all("copied_at" in e for e in saved[:3]) and "copied_at" not in saved[3]
    # The stop's save waited for the writes before it: the last state is the one on disk.
    state = load_checkpoint(node.checkpoint_dir, node.fingerprint, node.persistence.param_layout())
    assert state is not None and state["round"] == 3 and state["learner"]["step"] == 15


def test_a_round_end_write_that_fails_stops_the_node_at_its_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = persistence.save_checkpoint

    def full_disk(directory: Path, state: dict[str, Any], layout: Any) -> Path:
        if state["round"] == 1:
            raise OSError(28, "No space left on device")
        return real(directory, state, layout)

    monkeypatch.setattr(persistence, "save_checkpoint", full_disk)
    monkeypatch.setattr(persistence, "PARTIAL_SAVE_MIN_S", 1e3)
    monkeypatch.setattr(persistence, "PARTIAL_SAVE_S", 1e3)
    events = RecordingEventLog()
    node = Node(_config(tmp_path, checkpoint_every=1, max_rounds=3), events)
    with pytest.raises(OSError, match="No space left"):
        node.run()
    # Raised on the training thread at a later save, not lost in the writing thread.
    assert [e for e in events.of("checkpoint_saved") if e["round"] == 1] == []
    assert events.of("stopped") == []
