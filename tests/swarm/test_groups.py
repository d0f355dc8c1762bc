"""Learner groups in real processes (docs/scale.md, wiring plan step 7): six nodes with
--group-size 3 form two groups of three (identities picked so each half of the id space
holds three); once both groups have completed a round with all their members, one member of
each is killed with -9. The others go on: each completes rounds without its dead member (left
out at the deadline, or dropped while co-signing; once the census has dropped the dead, four
peers are below the split and the survivors form one group); then the four live nodes are
asked to finish, and their replicas end with one applied set and the same parameters."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from merge.identity import Identity
from node.signals import FINISH_SIGNAL
from tests.swarm.conftest import NodeProcess
from tests.swarm.group_keys import alternating_keys
from tests.swarm.replicas import saved_replica, settled_params
from tests.swarm.together import bootstrap_address, unused_port
from tests.timeouts import EXIT_S, START_S, covering

pytestmark = pytest.mark.swarm

RUN = "groups-test"
ROUNDS = 20
"""A cap only: once both survivors completed a round without their dead member, the four live
nodes are asked to finish (FINISH_SIGNAL: end the round in progress, linger, leave), so no
node trains rounds the assertions do not need, and no fixed count races the kill (with 8
rounds the laggard of a group that formed late trained ~30 s after the last assertion)."""
LINGER_S = 90
"""At most: each survivor lingers until every live peer is idle (--linger-until-done), so
the group rounds of the ones still training reach those done already."""
WAIT_S = 6
"""--group-wait (and the co-sign window, the same): a round without a dead member waits it out
once or twice before the census drops the dead, and a group whose members join mid-round
spends two of it on a co-sign timeout. Members of a live group are in within ~0.5 s of each
other once running, ~4-6 s at start-up (a round that leaves one out is followed by another:
the first phase waits for a complete one); 10 s cost each run ~16 s more (docs/testing.md)."""
GROUP_ROUND_S = 90
"""Both groups' first complete round (every node started), or a round without the dead."""
RUN_S = 150
"""The survivors' round in progress and their linger, to their exit."""
ARGS = (
    "--run-id", RUN, "--model", "tiny", "--inner-steps", "10", "--threads", "1",
    "--eval-batches", "0", "--heartbeat-period", "2", "--group-size", "3",
    "--group-epoch-rounds", "1", "--group-wait", str(WAIT_S), "--max-rounds", str(ROUNDS),
    "--linger", str(LINGER_S), "--linger-until-done", "--speed-factor", "2",
    "--emulated-step-s", "0.2", "--no-dashboard",
)  # fmt: skip


def _completed(
    node: NodeProcess, after: float, without: str | None = None, group: set[str] | None = None
) -> dict:
    def done(e: dict) -> bool:
        if e.get("event") != "group_round" or e["outcome"] != "completed" or e["time"] < after:
            return False
        return set(e["included"]) == group if without is None else without not in e["included"]

    what = f"a round of exactly {group}" if without is None else f"a round without {without}"
    return node.wait_for(done, GROUP_ROUND_S, what)


@pytest.mark.timeout(covering(START_S, 4 * GROUP_ROUND_S, RUN_S, EXIT_S))
@pytest.mark.parametrize(
    "mode", ["whole", "scatter", "folded"], ids=["whole_parts", "reduce_scatter", "folded"]
)
def test_two_groups_lose_a_member_each_and_the_live_replicas_end_as_one(
    launch: Callable[..., NodeProcess], tmp_path: Path, mode: str
) -> None:
    """With --group-scatter the same rounds run by reduce-scatter (dht.grouping_shards);
    folded (--group-shard-fetch --group-fold, docs/scale.md Session 29) each round's update
    is applied by its members' fetch round, held only as shards, the kill mid-run included."""
    keys = alternating_keys(tmp_path / "keys", RUN, 6)
    ids = [Identity.load(k).peer_id for k in keys]
    extra = {
        "whole": (),
        "scatter": ("--group-scatter",),
        "folded": ("--group-scatter", "--group-shard-fetch", "--group-fold"),
    }[mode]
    args = (*ARGS, *extra)
    # All six start at once: the joiners dial the bootstrap's known address until it listens.
    port = unused_port()
    boot = launch(*args, "--identity", str(keys[0]), "--port", str(port), name="node0")
    join = ("--peers", bootstrap_address(str(keys[0]), port))
    nodes = [boot] + [
        launch(*args, *join, "--identity", str(keys[i]), name=f"node{i}") for i in range(1, 6)
    ]
    assert join[1] in boot.wait_listening(START_S)
    # Nodes 2 and 3 (one of each group): before the census holds all six, the first three in
    # it may complete a round as one unsplit group (session 24: all start at once); the
    # split's groups are the id space's halves, or this wait fails.
    first = [_completed(nodes[2 + group], 0.0, group=set(ids[group::2])) for group in (0, 1)]
    assert first[0]["group_key"] != first[1]["group_key"], "two groups"

    killed_at = time.time()
    for dead in (nodes[4], nodes[5]):  # one member of each group
        dead.crash()
    for survivor, victim in ((2, 4), (3, 5)):
        # Its group without the dead, or, once the census has dropped them (4 peers: below
        # the merge threshold), the survivors' one group.
        round_ = _completed(nodes[survivor], killed_at, without=ids[victim])
        assert ids[survivor] in round_["included"]
        assert set(round_["included"]) <= set(ids[:4])

    for node in nodes[:4]:
        node.signal(FINISH_SIGNAL)
    for node in nodes[:4]:
        assert node.wait_exit(RUN_S) == 0, node.stderr_tail()
    replicas = [saved_replica(tmp_path / "homes" / f"node{i}") for i in range(4)]
    applied, settled = replicas[0]["applied"], settled_params(replicas[0])
    for round_ in first:  # each group's first complete round: its update (seq = round + 1)
        assert round_["round"] + 1 in applied.get(round_["group_key"], []), round_
    for replica in replicas[1:]:
        assert replica["applied"] == applied
        # One settled point (the raw params differ by the momentum tail of other orders).
        assert torch.allclose(settled_params(replica), settled, atol=1e-5)


PAIR_ROUNDS = 4
PAIR_S = 60
"""Two nodes' start, their PAIR_ROUNDS rounds and their linger, to their exit."""


@pytest.mark.timeout(covering(START_S, PAIR_S, EXIT_S))
def test_two_nodes_below_one_group_train_one_model(
    launch: Callable[..., NodeProcess], tmp_path: Path
) -> None:
    """A group-mode swarm of two (under dht.grouping.MIN_MEMBERS, so no group forms: a group
    of two could be voided by either member): each node publishes its own updates, as with
    groups off, and both replicas apply both nodes' updates and end as one. Before session 25
    neither applied anything: each trained alone on its residual, two models."""
    keys = alternating_keys(tmp_path / "keys", RUN, 2)
    args = (
        *ARGS[: ARGS.index("--max-rounds")], "--max-rounds", str(PAIR_ROUNDS),
        "--linger", "20", "--linger-until-done", "--speed-factor", "2",
        "--emulated-step-s", "0.2", "--no-dashboard", "--group-scatter",
    )  # fmt: skip
    port = unused_port()
    boot = launch(*args, "--identity", str(keys[0]), "--port", str(port), name="node0")
    join = ("--peers", bootstrap_address(str(keys[0]), port))
    other = launch(*args, *join, "--identity", str(keys[1]), name="node1")
    for node in (boot, other):
        assert node.wait_exit(covering(START_S, PAIR_S)) == 0, node.stderr_tail()
    ids = [Identity.load(k).peer_id for k in keys]
    replicas = [saved_replica(tmp_path / "homes" / f"node{i}") for i in range(2)]
    applied = replicas[0]["applied"]
    assert set(ids) <= set(applied), f"both nodes' updates applied: {sorted(applied)}"
    assert replicas[1]["applied"] == applied
    assert torch.allclose(settled_params(replicas[1]), settled_params(replicas[0]), atol=1e-5)
