"""A node without a network (--no-swarm, benchmarks) runs the same Trainer with an
OfflineSwarm: it merges its own updates, sizes them as the only learner, sends nothing."""

from __future__ import annotations

from pathlib import Path

from node.swarm_link import OfflineSwarm
from tests.node.test_runtime import offline_node


def test_an_offline_node_trains_alone_and_publishes_nowhere(tmp_path: Path) -> None:
    node = offline_node(tmp_path)
    assert node.swarm is None and isinstance(node.parts.swarm, OfflineSwarm)

    result = node.run_round()
    assert result is not None and result.accepted and result.learners == 1
    assert node.replica.num_applied == 1 and node.seq == 1
    assert node.published_seq == 0  # merged into its own replica, sent to nobody
    beat = node.heartbeat()
    assert beat.maddrs == [] and beat.num_lost == 0 and beat.latest_seq == 0
    assert node.status().peers == ()
