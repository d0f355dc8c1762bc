"""Learner groups in a node (node/group_publishing.py, docs/scale.md wiring plan step 4): a node
alone is a group of one whose update moves its replica exactly as its own fp32 update would,
through the same Trainer, with nothing left in its error feedback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dht.grouping import group_key, member_check
from dht.heartbeat import Heartbeat
from merge.group_update import Abandoned, GroupUpdate
from merge.identity import Identity
from node.group_publishing import GroupPublishing
from node.swarm_link import GroupContribution, OfflineSwarm, peers_finished, run_alone
from tests.node.test_runtime import offline_node


def test_a_node_alone_is_a_group_of_one_that_moves_like_its_own_fp32_update(
    tmp_path: Path,
) -> None:
    key = Identity.generate()  # one key (in two files): the data a node samples follows it
    for name in ("g", "a"):
        (tmp_path / name).mkdir()
        key.save(tmp_path / name / "id.key")
    grouped = offline_node(tmp_path / "g", group_size=1, codec="fp32")
    alone = offline_node(tmp_path / "a", codec="fp32")
    assert isinstance(grouped.parts.publishing, GroupPublishing)
    assert isinstance(grouped.parts.swarm, OfflineSwarm)
    for round_ in (1, 2):
        result = grouped.run_round()
        assert result is not None and result.accepted and result.learners == 1
        assert grouped.replica.applied == {group_key(""): list(range(1, round_ + 1))}
        assert alone.run_round() is not None
        assert torch.allclose(grouped.replica.params, alone.replica.params, atol=1e-6)
    publishing = grouped.parts.publishing
    assert not publishing.error_feedback().pending()  # its own group applied everything
    assert publishing.announced() == (0, 0)


def test_the_merge_bounds_group_updates_by_the_runs_own_reduction_clip(tmp_path: Path) -> None:
    """The signed-norm bound a group update is refused by (merge.group_update) clips members'
    norms as this run's reduction does, not by the default."""
    node = offline_node(tmp_path, group_size=1, group_max_norm_to_median=2.5)
    reduction = node.parts.publishing.publisher.pipeline.groups.reduction  # type: ignore[attr-defined]
    assert reduction.max_norm_to_median == 2.5


def test_lingering_ends_for_group_members_who_publish_no_update_of_their_own() -> None:
    """--linger-until-done: a learner-group member's updates are its group's (under the group
    key), so its heartbeat's latest seq stays 0 and this replica holds none of its own."""
    member = Heartbeat(peer_id="member", state="idle", latest_seq=0)
    assert peers_finished([member], lambda peer: -1, "me", 0)
    training = Heartbeat(peer_id="member", state="training", latest_seq=0)
    assert not peers_finished([training], lambda peer: -1, "me", 0)


def test_a_part_in_bf16_keeps_what_the_codec_rounded_off_in_its_error_feedback(
    tmp_path: Path,
) -> None:
    """Parts travel in the swarm's codec (bf16): the group applies what the part carried and
    the member keeps the rest (total - sent), never both, never neither."""
    node = offline_node(tmp_path, group_size=1, codec="bf16")
    publishing = node.parts.publishing
    assert isinstance(publishing, GroupPublishing) and publishing.part_codec == "bf16"
    before = node.replica.params.clone()
    assert node.run_round() is not None
    residual = publishing.error_feedback().residual
    assert publishing.error_feedback().pending()  # bf16's rounding, kept for the next round
    moved = float((node.replica.params - before).norm())
    assert 0 < float(residual.norm()) <= moved * 2.0**-6
    total = torch.randn(node.replica.numel, generator=torch.Generator().manual_seed(0))
    sent, payload = publishing.coded(total)
    assert payload is not None and len(payload) == 2 * total.numel()
    assert torch.equal(sent, total.to(torch.bfloat16).to(torch.float32))


def test_a_group_of_one_by_reduce_scatter_moves_like_one_of_whole_parts(tmp_path: Path) -> None:
    """--group-scatter signs the part's shard digests and completes a group of one through
    merge.group_shards: the replica moves exactly as with whole parts."""
    key = Identity.generate()
    for name in ("s", "w"):
        (tmp_path / name).mkdir()
        key.save(tmp_path / name / "id.key")
    sharded = offline_node(tmp_path / "s", group_size=1, codec="bf16", group_scatter=True)
    whole = offline_node(tmp_path / "w", group_size=1, codec="bf16")
    for _ in (1, 2):
        result = sharded.run_round()
        assert result is not None and result.accepted
        assert whole.run_round() is not None
        assert torch.equal(sharded.replica.params, whole.replica.params)
    assert sharded.replica.applied == whole.replica.applied


def test_a_node_behind_its_group_contributes_to_the_round_after_the_last_it_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node restarted behind its group (no member sends it a part: they decided their
    epoch without it) takes its group's round from its replica: the round after the last
    of its group's updates applied (seq = round + 1), with that round's epoch's grouping."""
    node = offline_node(tmp_path, group_size=1, codec="fp32")
    publishing = node.parts.publishing
    assert isinstance(publishing, GroupPublishing)
    rounds = publishing.groups.group_epoch_rounds
    monkeypatch.setattr(node.replica, "last_seq", lambda author: rounds + 2)
    contribution = publishing.contribution(torch.zeros(node.replica.numel), tokens=1)
    assert contribution is not None
    assert (contribution.header.round, contribution.header.epoch) == (rounds + 2, 1)
    assert publishing.announced() == (0, 1)


class Telling(OfflineSwarm):
    """An empty swarm that keeps each group update its node's rounds completed and each it
    was asked to pass a proof of on."""

    def __init__(self, meanwhile: Callable[[], None] = lambda: None) -> None:
        self.meanwhile = meanwhile
        """What reaches the node while its round collects (a pushed variant of it)."""
        self.outcomes: list[GroupUpdate | Abandoned] = []
        self.told: list[GroupUpdate] = []

    def contribute(self, contribution: GroupContribution) -> GroupUpdate | Abandoned:
        self.meanwhile()
        self.outcomes.append(run_alone(contribution))
        return self.outcomes[-1]

    def pass_on_evidence(self, update: GroupUpdate) -> None:
        self.told.append(update)


def test_a_members_own_round_refused_as_a_second_variant_sends_its_proof_on(
    tmp_path: Path,
) -> None:
    """rogue25 (bench.attack_group): a rogue member pushed its lone variant of a round to the
    honest members, which applied it before their own round completed; each then refused its
    group's update as `group_equivocation` and made no proof, so replicas that had applied the
    lone variant never learnt it. The node's own refused outcome now goes to the swarm's
    evidence path, as a pushed second variant always did."""
    key = Identity.generate()  # one key, two nodes: two variants of one group round
    nodes = []
    for name, lr in (("first", 1e-3), ("second", 3e-3)):
        (tmp_path / name).mkdir()
        key.save(tmp_path / name / "id.key")
        nodes.append(offline_node(tmp_path / name, group_size=1, codec="fp32", inner_lr=lr))
    publishing = nodes[1].parts.publishing
    assert isinstance(publishing, GroupPublishing)
    pipeline = publishing.publisher.pipeline
    swarms = [Telling()]

    def pushed() -> None:  # the first node's variant of the round, applied while collecting
        [first] = swarms[0].outcomes
        assert isinstance(first, GroupUpdate)
        check = member_check(publishing.run_id, first.head.group_key)
        assert pipeline.submit_group(first, check).accepted

    swarms.append(Telling(pushed))
    for node, swarm in zip(nodes, swarms, strict=True):
        node.parts.publishing.publisher.swarm = swarm  # type: ignore[attr-defined]
    assert nodes[0].run_round() is not None
    [first] = swarms[0].outcomes
    assert isinstance(first, GroupUpdate)

    result = nodes[1].run_round()

    [second] = swarms[1].outcomes
    assert isinstance(second, GroupUpdate) and second.seq == first.seq
    assert result is not None and not result.accepted
    assert swarms[1].told == [second]
    assert pipeline.group_evidence(second) is not None
    assert swarms[0].told == []


D0, D1 = "0" * 64, "1" * 64


def test_lingering_ends_only_once_peers_at_this_applied_set_hold_its_point() -> None:
    """CI (session 25): test_groups' survivors left at one applied set, one replica 1.4e-2
    apart (two variants of a root-group round, each applied on one side); the settle makes
    such replicas one point, and now they stay until it has."""
    sketch = [1.0, 2.0, 3.0]

    def idle(digest: str, values: list[float]) -> Heartbeat:
        return Heartbeat(
            peer_id="peer", state="idle", latest_seq=0, applied_digest=digest, sketch=values
        )

    def done(peer: Heartbeat) -> bool:
        return peers_finished([peer], lambda p: -1, "me", 0, {}, (D1, sketch))

    assert not done(idle(D1, [1.0, 2.0, 3.1]))  # one applied set, two points
    assert done(idle(D1, [1.0, 2.0, 3.0 + 1e-9]))  # one point, up to float rounding
    assert done(idle(D0, [9.0, 9.0, 9.0]))  # elsewhere: same_merged's to judge
    assert done(idle(D1, []))  # no sketch: nothing to compare
