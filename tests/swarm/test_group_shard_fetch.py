"""The shard fetch in real processes (docs/scale.md, Session 17): six nodes with
--group-size 3 --group-scatter --group-shard-fetch form two groups of three (identities
picked so each half of the id space holds three; no group holds fewer than three since
session 24, so the five nodes at --group-size 2 this test started before are refused);
each member fetches its slice of the other group's updates and the members apply them as one
step. At least one round is applied by shards (a `shard_round` event), and the six
replicas end with one applied set and the same settled parameters once the settle has run,
whichever rounds fell back to the whole fetch.

Since session 29 (fold29) the nodes run with --group-fold: a group's own update is folded
into its members' fetch round (seals, not shards, inside the group; nobody holds it whole), so
at least one fetch round applies its own group's update by shards too, and the replicas still
end as one."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from node.signals import FINISH_SIGNAL
from tests.swarm.conftest import NodeProcess
from tests.swarm.group_keys import alternating_keys
from tests.swarm.replicas import saved_replica, settled_params
from tests.timeouts import EXIT_S, START_S, covering

pytestmark = pytest.mark.swarm

RUN = "shard-fetch-test"
ROUNDS = 6
"""Group rounds every node takes part in before all six are asked to finish together
(FINISH_SIGNAL: end the round in progress, linger, leave). With `--max-rounds 6` alone the
bootstrap, started first, finished first and its fixed linger ended before its group's last
round existed (session 18: one replica short of it, 2 runs of 2)."""
MAX_ROUNDS = 30
"""A cap only."""
WAIT_S = 5
LINGER_S = 40
"""Every node lingers this long after its last round (no --linger-until-done): groups apply
each other's updates in other orders (held back for a fetch round, deferred past a fold),
which Delayed Nesterov's folds turn into params apart by more than rounding; the settle
(docs/consistency.md) brings the replicas to one point once their applied set has held for
5 heartbeat periods."""
RUN_S = 120
"""Every node's ROUNDS group rounds (all six started)."""
ARGS = (
    "--run-id", RUN, "--model", "tiny", "--inner-steps", "6", "--threads", "1",
    "--eval-batches", "0", "--heartbeat-period", "2", "--group-size", "3",
    "--group-epoch-rounds", "10", "--group-wait", str(WAIT_S), "--max-rounds", str(MAX_ROUNDS),
    "--linger", str(LINGER_S), "--speed-factor", "2",
    "--emulated-step-s", "0.2", "--no-dashboard", "--group-scatter", "--group-shard-fetch",
    "--group-fold",
)  # fmt: skip


NODES = 6


def _group_rounds(node: NodeProcess, count: int, timeout_s: float) -> None:
    """Wait until `node` has ended `count` group rounds (any outcome)."""
    seen = 0

    def nth(event: dict) -> bool:
        nonlocal seen
        seen += event.get("event") == "group_round"
        return seen >= count

    node.wait_for(nth, timeout_s, f"{count} group rounds")


@pytest.mark.skipif(
    not os.environ.get("DILOCO_SHARD_FETCH_TEST"),
    reason="quarantined (DILOCO_SHARD_FETCH_TEST=1 runs it): 79-100 s, over a new swarm test's "
    "60 s and the suite's budget; passed 2 of 2 on main since its nodes finish together "
    "(docs/scale.md, Session 18)",
)
@pytest.mark.timeout(covering(START_S, RUN_S, LINGER_S, EXIT_S))
def test_two_groups_fetch_each_others_updates_by_slices_and_end_as_one(
    launch: Callable[..., NodeProcess], tmp_path: Path
) -> None:
    keys = alternating_keys(tmp_path / "keys", RUN, NODES)
    boot = launch(*ARGS, "--identity", str(keys[0]), name="node0")
    join = ("--peers", boot.wait_listening(START_S)[0])
    nodes = [boot] + [
        launch(*ARGS, *join, "--identity", str(keys[i]), name=f"node{i}") for i in range(1, NODES)
    ]
    for node in nodes:
        _group_rounds(node, ROUNDS, RUN_S)
    for node in nodes:
        node.signal(FINISH_SIGNAL)
    for node in nodes:
        assert node.wait_exit(LINGER_S + EXIT_S) == 0, node.stderr_tail()
    rounds = [e for node in nodes for e in node.of("shard_round")]
    by_shards = [e for e in rounds if e["outcome"] == "applied" and e["applied"] >= 1]
    outcomes = sorted(e["outcome"] for e in rounds)
    assert by_shards, f"no round applied by shards: {outcomes}"
    own = [e for e in by_shards if any(c.startswith(f"{e['group_key']}#") for c in e["candidates"])]
    assert own, f"no fetch round applied its own group's update (the fold): {outcomes}"
    replicas = [saved_replica(tmp_path / "homes" / f"node{i}") for i in range(NODES)]
    applied, settled = replicas[0]["applied"], settled_params(replicas[0])
    assert {"groups.0b0", "groups.0b1"} <= set(applied), applied
    for replica in replicas[1:]:
        assert replica["applied"] == applied
        assert torch.allclose(settled_params(replica), settled, atol=1e-5)
