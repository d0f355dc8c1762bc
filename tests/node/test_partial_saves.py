"""Partial rounds saved in the background (issue 23): what a kill -9 finds on disk resumes
the round it belongs to, and never a round that was finished and published since."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from node import persistence
from node.config import JoinConfig
from node.events import RecordingEventLog
from node.runtime import Node
from tests.node.test_stopping import StopAtStep

SMALL_CORPUS = str(Path(torch.__file__).parent / "functional.py")


def _config(home: Path, **overrides: Any) -> JoinConfig:
    base: dict[str, Any] = dict(
        model="tiny",
        data=SMALL_CORPUS,
        inner_steps=5,
        batch_size=2,
        eval_batches=0,
        threads=1,
        identity=str(home / "id.key"),
        checkpoint_dir=str(home / "ckpt"),
        log_format="json",
        swarm=False,
        dashboard=False,
        checkpoint_every=5,  # as bench.chaos runs it: no full save after every round
        max_rounds=2,
    )
    return JoinConfig(**{**base, **overrides})


class CopyAt(RecordingEventLog):
    """At inner step `step` of `round`, copies the node's home as a kill -9 there would leave
    it (the background write in flight finished first): its checkpoint and its seq ledger."""

    def __init__(self, round_: int, step: int, home: Path, copy: Path) -> None:
        super().__init__()
        self.at, self.home, self.copy = (round_, step), home, copy
        self.node: Node | None = None
        self.on_disk: dict[str, Any] | None = None
        """The last save on disk when copied (a save is skipped while one is in flight)."""

    def progress(self, **fields: Any) -> None:
        if (fields["round"], fields["step"]) != self.at or self.node is None:
            return
        writing = self.node.parts.persistence._background
        if writing is not None:
            writing.join()
        self.on_disk = self.of("checkpoint_saved")[-1]
        shutil.copytree(self.home, self.copy, ignore=shutil.ignore_patterns(".lock"))


def _save_at_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step it can (one background write at a time)."""
    monkeypatch.setattr(persistence, "PARTIAL_SAVE_MIN_S", 1e-9)
    monkeypatch.setattr(persistence, "PARTIAL_SAVE_S", 1e-9)


def test_a_partial_round_finished_since_it_was_saved_is_not_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save_at_every_step(monkeypatch)
    home, killed = tmp_path / "home", tmp_path / "killed"
    home.mkdir()
    events = CopyAt(round_=2, step=1, home=home, copy=killed)
    first = Node(_config(home), events)
    events.node = first
    first.run()
    round_one = [e for e in events.of("checkpoint_saved") if e["background"] and e["round"] == 0]
    assert round_one and round_one[-1]["step"] > 0, "round 1 was saved while it ran"
    assert killed.exists()

    again = RecordingEventLog()
    restarted = Node(_config(killed, max_rounds=1), again)
    restarted.run()
    (resumed,) = again.of("resumed")
    # Round 1 was published (seq 1) after its last save: resuming it would publish its
    # steps a second time.
    assert resumed["step"] == 0 and resumed["stale_partial_step"] == round_one[-1]["step"]
    (done,) = again.of("round_done")
    assert done["resumed_at_step"] == 0 and done["steps"] == 5
    assert done["seq"] == 2


def test_a_partial_round_still_running_when_saved_is_resumed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save_at_every_step(monkeypatch)
    home, killed = tmp_path / "home", tmp_path / "killed"
    home.mkdir()
    events = CopyAt(round_=1, step=4, home=home, copy=killed)
    first = Node(_config(home, max_rounds=1), events)
    events.node = first
    first.run()

    again = RecordingEventLog()
    Node(_config(killed, max_rounds=1), again).run()
    (resumed,) = again.of("resumed")
    # Saved at every step it could: at step 3, unless step 2's write still ran (a loaded disk).
    kept = events.on_disk
    assert kept is not None and kept["background"] and 0 < kept["step"] <= 3
    assert resumed["step"] == kept["step"] and resumed["stale_partial_step"] is None
    # What it kept says when it was copied (bench.chaos counts the steps lost from there).
    assert resumed["copied_at"] == kept["copied_at"]
    (done,) = again.of("round_done")
    assert (done["resumed_at_step"], done["learner_step"], done["seq"]) == (kept["step"], 5, 1)


@pytest.mark.swarm
def test_a_finished_round_stopped_while_it_waits_for_the_swarm_is_published_after_a_restart(
    tmp_path: Path,
) -> None:
    # One step per round: the round ends while hivemind, p2pd and the DHT still start beside
    # it, so it waits for the swarm (its state check), and is stopped there.
    network = dict(swarm=True, host="127.0.0.1", port=0, inner_steps=1, max_rounds=1)
    stopping = StopAtStep(round_=1, step=1)
    first = Node(_config(tmp_path, **network), stopping)
    stopping.node = first
    first.run()
    saved = stopping.of("checkpoint_saved")[-1]
    assert (saved["round"], saved["step"]) == (0, 1)
    assert not stopping.of("round_done")

    again = RecordingEventLog()
    Node(_config(tmp_path, **network), again).run()
    assert again.of("resumed")[0]["step"] == 1
    names = [e.get("name", e["event"]) for e in again.events]
    # Nothing stepped, so the swarm starts at the round's end; published once it is entered.
    assert names.index("listening") < names.index("round_done")
    (done,) = again.of("round_done")
    assert (done["resumed_at_step"], done["steps"], done["learner_step"]) == (1, 1, 1)
    assert done["seq"] == 1
