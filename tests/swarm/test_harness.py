"""The harness itself: a node runs to completion, a crash is reaped, a failure explains itself."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.swarm.conftest import NodeProcess

pytestmark = [pytest.mark.swarm, pytest.mark.lone]  # one node at a time: beside the swarm tests
Launch = Callable[..., NodeProcess]
TINY = ["--model", "tiny", "--threads", "1"]


def test_a_lone_node_runs_its_rounds_and_leaves_nothing_behind(launch: Launch) -> None:
    node = launch(*TINY, "--inner-steps", "5", "--max-rounds", "2", "--eval-batches", "1")
    done = node.wait_for(
        lambda e: e.get("event") == "round_done" and e["round"] == 2, 180, "round 2"
    )
    assert node.wait_exit(60) == 0, node.stderr_tail()
    assert [e["round"] for e in node.of("round_done")] == [1, 2]
    assert done["num_applied"] == 2
    assert node.of("stopped")[-1]["reason"] == "max_rounds"
    assert node.leftover_processes() == []


def test_a_crashed_and_frozen_node_is_reaped(launch: Launch) -> None:
    node = launch(*TINY, "--inner-steps", "1000", "--eval-batches", "1")
    started = node.wait_for_event("started", 120)
    assert node.peer_id == started["peer_id"]
    node.pause()
    node.resume()
    node.kill()
    assert node.wait_exit(10) == -9
    node.reap()
    assert node.leftover_processes() == []


def test_a_node_that_exits_early_fails_the_wait_at_once_with_its_stderr(launch: Launch) -> None:
    node = launch("--model", "no-such-model")
    with pytest.raises(AssertionError) as info:
        node.wait_for_event("round_done", 120)
    message = str(info.value)
    assert "exited (exit code" in message
    assert "no-such-model" in message
    assert node.wait_exit(10) != 0
