"""Restarts (issue 23): a node killed with -9 mid-round loses at most a few seconds of inner
steps, and a restarted node trains before it enters the swarm (p2pd, the DHT), evaluates or
checks the swarm's state, then ends with its peer's replica."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from node.persistence import PARTIAL_SAVE_S
from tests.swarm.conftest import NodeProcess
from tests.swarm.replicas import saved_replica, settled_params
from tests.timeouts import covering

pytestmark = pytest.mark.swarm

START_S = 120
ROUND_S = 240
WRITE_SLACK_S = 5.0
"""A background write's own time on a loaded machine: its event comes when the file is in."""


def _saved_mid_round(node: NodeProcess, after: float) -> dict:
    return node.wait_for(
        lambda e: e.get("event") == "checkpoint_saved" and e["step"] > 0 and e["time"] > after,
        START_S,
        "a checkpoint of the round in progress",
    )


@pytest.mark.timeout(covering(4 * START_S))
def test_kill_9_mid_round_loses_at_most_a_few_seconds_of_steps(
    launch: Callable[..., NodeProcess],
) -> None:
    # 0.1 s per inner step, 300 per round: the kill lands mid-round.
    run = ("--no-swarm", "--model", "tiny", "--inner-steps", "300", "--threads", "1",
           "--eval-batches", "0", "--speed-factor", "2", "--emulated-step-s", "0.05")  # fmt: skip
    node = launch(*run)
    first = _saved_mid_round(node, 0.0)
    _saved_mid_round(node, first["time"])  # saved again: it keeps saving as it goes
    time.sleep(PARTIAL_SAVE_S / 2)
    killed_at = time.time()
    node.crash()
    last = max((e for e in node.of("checkpoint_saved")), key=lambda e: e["time"])
    assert last["round"] == 0 and 0 < last["step"] < 300
    assert killed_at - last["time"] <= PARTIAL_SAVE_S + WRITE_SLACK_S, (killed_at, last)

    restarted = launch(*run)
    resumed = restarted.wait_event("resumed", START_S)
    # From the last save we saw, or a later one: a save writes its file before it prints its
    # event, and the kill can land between the two (CI of session 25: resumed at step 35, the
    # last event read said 22). An older save, or none, fails here.
    assert resumed["round"] == 0 and last["step"] <= resumed["step"] < 300, (resumed, last)
    first_step = restarted.wait_event("progress", START_S)  # the first one comes at once
    assert (first_step["round"], first_step["step"]) == (1, resumed["step"] + 1)


@pytest.mark.timeout(covering(START_S, 5 * ROUND_S))
def test_a_restarted_node_trains_first_catches_up_beside_and_ends_with_its_peers_replica(
    launch: Callable[..., NodeProcess], tmp_path: Path
) -> None:
    run = ("--model", "tiny", "--inner-steps", "10", "--threads", "1", "--eval-batches", "2")
    # The peer serves (lingers) after its rounds until stopped, the node restarts meanwhile.
    peer = launch(*run, "--max-rounds", "4", "--linger", "400", name="peer")
    join = ("--peers", peer.wait_listening(START_S)[0])
    node = launch(*run, *join, "--max-rounds", "1", name="node")
    assert node.wait_exit(ROUND_S) == 0

    until_done = ("--linger", "150", "--linger-until-done")  # our updates merged there too
    restarted = launch(*run, *join, "--max-rounds", "3", *until_done, name="node")
    evaluated = restarted.wait_event("evaluated", ROUND_S)
    events = [e["event"] if e["event"] != "startup_phase" else e["name"] for e in restarted.events]
    first_step = events.index("first_batch")
    assert events.index("resumed") < first_step < events.index("evaluated")
    restarted.wait_event("listening", ROUND_S)
    events = [e["event"] if e["event"] != "startup_phase" else e["name"] for e in restarted.events]
    # It trained before it imported hivemind, started p2pd or bootstrapped its DHT member.
    assert first_step < events.index("p2pd") < events.index("listening")
    restarted.wait_for(lambda e: e.get("name") == "state_check", ROUND_S, "the state check")
    events = [e["event"] if e["event"] != "startup_phase" else e["name"] for e in restarted.events]
    assert first_step < events.index("state_check")  # it trained while it caught up
    assert evaluated["round"] >= 1  # the replica it resumed, or the peer's it downloaded
    assert restarted.wait_exit(ROUND_S) == 0
    peer.stop()

    mine, theirs = (saved_replica(tmp_path / "homes" / name) for name in ("node", "peer"))
    assert mine["applied"] == theirs["applied"]
    # Same applied set, so the same settled point (the raw params differ by the momentum
    # tail whenever the two applied updates in other orders).
    assert torch.allclose(settled_params(mine), settled_params(theirs), atol=1e-5)
