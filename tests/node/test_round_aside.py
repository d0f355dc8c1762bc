"""A round that ends before the swarm is entered (issue 23): it is set aside with its end
parameters and the next round trains at once; it is published, once, in seq order, at the
first step boundary after the state check, and a kill -9 while it waits loses neither it nor
publishes it twice."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from node.events import RecordingEventLog
from node.runtime import Node
from node.swarm_start import StartingSwarm
from tests.node.test_partial_saves import _config

CAUGHT_UP_TIMEOUT_S = 120.0
"""Bound on the wait for the swarm's start (hivemind's imports, p2pd) on a loaded machine."""

NETWORK = dict(swarm=True, host="127.0.0.1", port=0, inner_steps=3)


class AfterRoundOne(RecordingEventLog):
    """Records events and the node's replica as round 1's `round_done` reports it."""

    def __init__(self) -> None:
        super().__init__()
        self.node: Node | None = None
        self.after_round_one: torch.Tensor | None = None

    def emit(self, event: str, **fields: Any) -> None:
        super().emit(event, **fields)
        if event == "round_done" and fields["round"] == 1 and self.node is not None:
            self.after_round_one = self.node.replica.snapshot()[0].clone()


class HoldUntilEntered(AfterRoundOne):
    """Records every inner step as a `step` event; at inner step 1 of round `hold` (reported
    while a round waits aside) holds the training thread until the swarm is entered and the
    state checked, letting its DHT fork there as the loop would between two steps. With
    `copy`, first copies the node's home as a kill -9 would leave it there."""

    def __init__(self, hold: int, copy: Path | None = None) -> None:
        super().__init__()
        self.hold, self.copy = hold, copy
        self.caught_up_before_hold: bool | None = None

    def progress(self, **fields: Any) -> None:
        self.emit("step", round=fields["round"], step=fields["step"])
        if (fields["round"], fields["step"]) != (self.hold, 1) or self.node is None:
            return
        swarm = self.node.parts.swarm
        assert isinstance(swarm, StartingSwarm)
        self.caught_up_before_hold = swarm.caught_up()
        if self.copy is not None:
            writing = self.node.parts.persistence._background
            if writing is not None:
                writing.join()  # the set-aside round's save, on disk before the "kill"
            home = self.node.checkpoint_dir.parent
            shutil.copytree(home, self.copy, ignore=shutil.ignore_patterns("*.lock", ".lock"))
        deadline = time.monotonic() + CAUGHT_UP_TIMEOUT_S
        while not swarm.caught_up():
            assert time.monotonic() < deadline, "the swarm did not start"
            swarm.step_boundary()
            threading.Event().wait(0.05)


def _names(events: RecordingEventLog) -> list[tuple[str, Any]]:
    return [(e["event"], e.get("round")) for e in events.events]


@pytest.mark.swarm
def test_a_round_ending_before_the_swarm_is_entered_waits_aside_while_the_next_one_trains(
    tmp_path: Path,
) -> None:
    events = HoldUntilEntered(hold=2)
    node = Node(_config(tmp_path, max_rounds=3, **NETWORK), events)
    events.node = node
    node.run()

    # Round 1 ended before the swarm was entered (hivemind, p2pd and the DHT start beside
    # the first step): set aside, saved as a finished round, and round 2 trained meanwhile.
    assert events.caught_up_before_hold is False
    (aside,) = events.of("round_set_aside")
    assert (aside["round"], aside["steps"]) == (1, 3)
    saved = [e for e in events.of("checkpoint_saved") if e["step"] == 3 and e["round"] == 0]
    assert saved, "the round set aside was saved as a finished round"
    names = _names(events)
    first_of_round_2 = names.index(("step", 2))
    assert names.index(("round_set_aside", 1)) < first_of_round_2
    # Published at round 2's first step boundary after the state check, before round 2's end.
    assert first_of_round_2 < names.index(("round_done", 1)) < names.index(("round_done", 2))
    done = events.of("round_done")
    assert [(d["round"], d["seq"], d["steps"]) for d in done] == [(1, 1, 3), (2, 2, 3), (3, 3, 3)]
    # Reported as it ended: its learner step, and the wait aside out of its round time.
    assert [d["learner_step"] for d in done] == [3, 6, 9]
    assert done[0]["aside_s"] > 0 and done[1]["aside_s"] == done[2]["aside_s"] == 0
    # Every round's update applied once, in seq order; nothing left to resume.
    assert node.replica.applied[node.peer_id] == [1, 2, 3]
    assert node.trainer.partial is None


@pytest.mark.swarm
def test_a_kill_while_a_round_waits_aside_loses_it_not_and_publishes_it_once(
    tmp_path: Path,
) -> None:
    home, killed = tmp_path / "home", tmp_path / "killed"
    home.mkdir()
    events = HoldUntilEntered(hold=2, copy=killed)
    first = Node(_config(home, max_rounds=3, **NETWORK), events)
    events.node = first
    first.run()
    assert events.of("round_set_aside") and killed.exists()
    (one,) = [d for d in events.of("round_done") if d["round"] == 1]

    again = AfterRoundOne()
    restarted = Node(_config(killed, max_rounds=2, **NETWORK), again)
    again.node = restarted
    restarted.run()
    (resumed,) = again.of("resumed")
    # The finished round as it was set aside: nothing of it redone, its update the same.
    assert (resumed["round"], resumed["step"], resumed["stale_partial_step"]) == (0, 3, None)
    done = again.of("round_done")
    assert [(d["round"], d["seq"], d["resumed_at_step"]) for d in done] == [(1, 1, 3), (2, 2, 0)]
    assert done[0]["learner_step"] == 3 and done[0]["loss"] == one["loss"]
    assert restarted.replica.applied[restarted.peer_id] == [1, 2]
    # Round 1's update, published by the restart from what was saved aside, is the one the
    # killed node published: from the same replica, the same replica after it.
    assert one["num_applied"] == done[0]["num_applied"] == 1
    before, after = events.after_round_one, again.after_round_one
    assert before is not None and after is not None
    torch.testing.assert_close(after, before, rtol=0, atol=1e-6)
