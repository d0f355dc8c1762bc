"""The node's structure: heartbeats and status are cheap reads of figures kept elsewhere."""

from __future__ import annotations

from pathlib import Path

import torch

from dht.heartbeat import Heartbeat
from merge.replica import Replica
from merge.sketch import ReplicaSketch
from node.config import JoinConfig
from node.events import RecordingEventLog
from node.runtime import Node, peers_finished

SMALL_CORPUS = str(Path(torch.__file__).parent / "functional.py")


def offline_node(tmp_path: Path, **overrides: object) -> Node:
    config = JoinConfig(
        **{
            "model": "tiny",
            "data": SMALL_CORPUS,
            "inner_steps": 2,
            "batch_size": 2,
            "eval_batches": 1,
            "threads": 1,
            "identity": str(tmp_path / "id.key"),
            "checkpoint_dir": str(tmp_path / "ckpt"),
            "log_format": "json",
            "swarm": False,
            **overrides,
        }  # type: ignore[arg-type]
    )
    return Node(config, RecordingEventLog())


class CountingSketcher:
    def __init__(self, inner: ReplicaSketch) -> None:
        self.inner = inner
        self.calls = 0

    def settled(self, replica: Replica) -> list[float]:
        self.calls += 1
        return self.inner.settled(replica)


def test_heartbeats_reuse_the_sketch_taken_when_the_replica_changed(tmp_path: Path) -> None:
    node = offline_node(tmp_path)
    sketcher = CountingSketcher(node.sketcher)
    node.sketcher = sketcher  # type: ignore[assignment]
    for _ in range(5):
        node.heartbeat()
    assert sketcher.calls == 0, "a heartbeat sketched the replica (heavy work on the swarm loop)"

    node.run_round()
    beat = node.heartbeat()
    assert sketcher.calls == 1  # once, where the own update was merged
    assert beat.num_applied == node.replica.num_applied == 1
    assert beat.applied_digest == node.replica.applied_digest()
    assert beat.sketch == sketcher.inner.settled(node.replica)
    assert beat.round == 1 and beat.latest_seq == 0  # offline: nothing published
    assert beat.merged_by_author == {node.peer_id: 1}


def test_status_is_one_snapshot_of_the_node(tmp_path: Path) -> None:
    node = offline_node(tmp_path)
    node.run_round()
    status = node.status()
    assert status.run_id == node.config.run_id and status.fingerprint == node.fingerprint
    assert status.own.round == 1 and status.own.loss is not None
    assert status.peers == () and status.fetches == 0


def test_heartbeats_report_the_inner_rate_that_peers_size_rounds_by(tmp_path: Path) -> None:
    node = offline_node(tmp_path, dynamic_h=True, inner_steps=3)
    assert node.heartbeat().steps_per_s == 0.0  # not measured yet

    node.run_round()
    done = node.events.of("round_done")[-1]  # type: ignore[attr-defined]
    assert done["steps"] == done["planned_steps"] == 3  # alone: the fastest runs H
    assert node.heartbeat().steps_per_s == done["steps_per_s"] > 0


def test_lingering_ends_once_every_peer_finished_and_the_last_updates_crossed() -> None:
    applied = {"a": 4, "b": 2}

    def beat(peer: str, state: str, latest: int, has_mine: int = 3) -> Heartbeat:
        return Heartbeat(
            peer_id=peer, state=state, latest_seq=latest, merged_by_author={"me": has_mine}
        )

    def finished(*peers: Heartbeat) -> bool:
        return peers_finished(list(peers), applied.__getitem__, "me", 3)

    assert finished()
    assert finished(beat("a", "idle", 4), beat("b", "idle", 2))
    assert not finished(beat("a", "idle", 4), beat("b", "training", 2))
    assert not finished(beat("a", "idle", 5))  # its last update is not here yet
    assert not finished(beat("a", "idle", 4, has_mine=2))  # our last one is not there yet
