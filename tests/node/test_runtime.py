"""The node's structure: heartbeats and status are cheap reads of figures kept elsewhere."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dht.heartbeat import Heartbeat
from merge.replica import Replica
from merge.sketch import ReplicaSketch
from node.builders import build_run_spec
from node.config import JoinConfig
from node.data import Corpus
from node.events import RecordingEventLog
from node.runtime import Node
from node.swarm_link import peers_finished

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
            "dashboard": False,  # node.events stays the recording log the tests read
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
    sketcher = CountingSketcher(node.telemetry.sketcher)
    node.telemetry.sketcher = sketcher  # type: ignore[assignment]
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


def test_lingering_waits_for_a_group_update_a_peer_merged_that_is_not_here_yet() -> None:
    """A learner group's last update, completed by two members while the other two were
    already lingering, is under the group key (no member's latest seq names it): a member
    that has not merged it does not leave while an idle peer's heartbeat lists it merged, and
    one that has does not leave while a peer lacks it (it may be the last holder)."""

    def beat(merged: dict[str, int]) -> Heartbeat:
        return Heartbeat(peer_id="a", state="idle", latest_seq=0, merged_by_author=merged)

    here = {"groups.0b": 5, "groups.0b1": 3}
    ahead = beat({"groups.0b": 6, "groups.0b1": 3})
    assert not peers_finished([ahead], lambda peer: -1, "me", 0, here)
    assert peers_finished([ahead], lambda peer: -1, "me", 0, {**here, "groups.0b": 6})
    behind = beat({"groups.0b": 4, "groups.0b1": 3})  # it lacks one we hold: we stay to serve
    assert not peers_finished([behind], lambda peer: -1, "me", 0, here)
    assert peers_finished([beat(dict(here))], lambda peer: -1, "me", 0, here)


def test_look_ahead_starts_rounds_ahead_of_the_replica_along_its_momentum(
    tmp_path: Path,
) -> None:
    """--correction lookahead: the learner starts where the outer momentum carries the replica
    in the swarm rounds its last update took to land (offline: none, so at the replica)."""
    node = offline_node(tmp_path, correction="lookahead", correction_strength=1.0)
    node.run_round()  # M = 1: the update folds the momentum in
    momentum = node.replica.outer.momentum_buffer.clone()
    assert bool(momentum.any()) and node.parts.publisher.delay == 0.0
    start, applied = node.parts.publishing.round_start()
    assert torch.equal(start, node.replica.params) and applied == 1

    node.parts.publisher.delay = 2.0  # as if its last update had landed two swarm rounds late
    expected = node.replica.params - 2.0 * node.merge_config.outer.lr * momentum
    loaded: list[torch.Tensor] = []
    load = node.learner.load_params
    node.learner.load_params = lambda flat: (loaded.append(flat.clone()), load(flat))[1]  # type: ignore[method-assign]
    node.run_round()
    torch.testing.assert_close(loaded[0], expected)
    assert node.replica.num_applied == 2  # the update from that start merged as any other


def test_look_ahead_is_fingerprinted_and_refused_with_fragments() -> None:
    corpus = Corpus(np.zeros(4096, dtype=np.uint8), vocab_size=256, source="zeros")

    def fingerprint(**kw: object) -> str:
        return build_run_spec(JoinConfig(**kw), corpus).fingerprint  # type: ignore[arg-type]

    assert fingerprint(correction="lookahead") != fingerprint()
    with pytest.raises(ValueError, match="--fragments"):
        JoinConfig(correction="lookahead", fragments=2)
