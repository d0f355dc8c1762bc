"""Merging learner groups' updates (merge.pipeline submit_group, docs/scale.md wiring plan
step 5): a group update is applied as one unit under its group key, by every replica alike
and once; anything its members did not all sign, or of members outside its key, is refused
and counted, and the replica is left as it was."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import group_key, member_check, peer_bits
from merge.group_pipeline import variant_of
from merge.group_update import (
    ContributionHeader,
    GroupReduction,
    GroupUpdate,
    RoundFields,
)
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.weighting import StalenessConfig, TokenWeightConfig
from tests.factories import FINGERPRINT

RUN = "run-groups"
NUMEL = 6
CONFIG = MergeConfig(
    outer=OuterConfig(kind="nesterov", lr=0.5, momentum=0.5),
    staleness=StalenessConfig(kind="polynomial", a=0.5),
    token_weight=TokenWeightConfig(reference_tokens=1000),
    max_inner_steps=100,
    max_tokens_per_step=100,
)
IDS = [Identity.generate() for _ in range(4)]


def _pipeline() -> UpdatePipeline:
    start = torch.linspace(1.0, 2.0, NUMEL)
    replica = Replica(start, make_outer_optimizer(CONFIG.outer, NUMEL))
    pipeline = UpdatePipeline(replica, CONFIG, FINGERPRINT)
    pipeline.run_id = RUN
    return pipeline


def _update(
    members: list[Identity],
    key: str = group_key(""),
    round_: int = 2,
    stale: list[tuple[int, int]] | None = None,
    scale: float = 1.0,
) -> GroupUpdate:
    """`stale`: each member's signed (base_applied, published_applied); the round's by default.
    `scale`: of every member's pseudo-gradient."""
    reduction = GroupReduction(
        group_key=key, epoch=0, round=round_, members=[m.peer_id for m in members]
    )
    for i, member in enumerate(members):
        base, published = (round_, round_) if stale is None else stale[i]
        fields = RoundFields(
            run_id=RUN, group_key=key, epoch=0, round=round_, learners=2, base_applied=base,
            published_applied=published,
        )  # fmt: skip
        tensor = torch.full((NUMEL,), 0.01 * (i + 1) * scale)
        reduction.contribute(ContributionHeader.of(tensor, member, fields, 500), tensor)
    reduction.close()
    for member in sorted(members, key=lambda m: m.peer_id):
        reduction.cosign(member.peer_id, member.sign(reduction.statement(member.peer_id)))
    assert isinstance(reduction.outcome, GroupUpdate)
    return reduction.outcome


def test_every_replica_applies_a_group_update_alike_and_once() -> None:
    update = _update(IDS[:3])
    replicas = [_pipeline(), _pipeline()]
    in_group = member_check(RUN, update.head.group_key)
    for pipeline in replicas:
        result = pipeline.submit_group(update, in_group)
        assert result.accepted and result.author == group_key("") and result.seq == 3
        assert result.learners == 2
        assert pipeline.replica.applied == {group_key(""): [3]}
        again = pipeline.submit_group(update, in_group)
        assert not again.accepted and again.reason == "duplicate"
    assert torch.equal(replicas[0].replica.params, replicas[1].replica.params)
    assert not torch.equal(replicas[0].replica.params, torch.linspace(1.0, 2.0, NUMEL))


def _refusal(update: GroupUpdate, in_group: object = None) -> str | None:
    pipeline = _pipeline()
    check = member_check(RUN, update.head.group_key) if in_group is None else in_group
    before = pipeline.replica.params.clone()
    result = pipeline.submit_group(update, check)  # type: ignore[arg-type]
    assert not result.accepted
    assert torch.equal(pipeline.replica.params, before) and pipeline.replica.num_applied == 0
    assert pipeline.rejections[result.reason or ""] == 1
    return result.reason


def test_a_group_update_its_members_did_not_all_sign_is_refused_and_counted() -> None:
    update = _update(IDS[:3])
    moved = GroupUpdate(
        update.contributions, update.shard_digests, update.cosignatures, update.aggregate * 2
    )
    assert _refusal(moved) == "group_shard_mismatch"
    one_less = GroupUpdate(
        update.contributions, update.shard_digests, update.cosignatures[:-1], update.aggregate
    )
    assert _refusal(one_less) == "group_missing_cosignature"
    assert _refusal(update, lambda peer: False) == "group_not_a_member"
    short = GroupUpdate(
        update.contributions, update.shard_digests, update.cosignatures, update.aggregate[:-1]
    )
    assert _refusal(short) in {"group_shard_mismatch", "group_wrong_size"}


def test_a_group_update_of_members_outside_its_key_is_refused() -> None:
    """Membership is a function of the peer id: a key whose prefix a member's position does
    not start with does not hold that member."""
    outsider = Identity.generate()
    while peer_bits(RUN, outsider.peer_id)[0] != "0":
        outsider = Identity.generate()
    update = _update([outsider], key=group_key("1"))
    assert _refusal(update) == "group_not_a_member"


@pytest.mark.parametrize("round_", [0, 5])
def test_group_updates_of_another_run_are_refused(round_: int) -> None:
    update = _update(IDS[:2], round_=round_)
    pipeline = _pipeline()
    pipeline.run_id = "another-run"
    result = pipeline.submit_group(update, member_check(RUN, update.head.group_key))
    assert not result.accepted and result.reason == "group_wrong_run"


def test_a_group_update_is_as_stale_as_the_median_of_its_members_signed_rounds() -> None:
    """Each member signs its own replica's applied counts; the group's staleness is their
    (lower) median, the same on every replica: one member claiming a very stale (or fresh)
    round does not set it, and a staler group update weighs less."""
    fresh = _update(IDS[:3], stale=[(10, 10), (9, 10), (10, 10)])
    stale = _update(IDS[:3], stale=[(4, 10), (0, 12), (7, 9)])  # stalenesses 6, 12, 2
    one_liar = _update(IDS[:3], stale=[(10, 10), (0, 5000), (10, 11)])
    assert (fresh.staleness, stale.staleness, one_liar.staleness) == (0, 6, 1)
    header = stale.update_header(FINGERPRINT, 10)
    assert header.staleness == 6 and header.published_applied == 12
    results = []
    for update in (fresh, stale):
        pipeline = _pipeline()
        results.append(pipeline.submit_group(update, member_check(RUN, update.head.group_key)))
    assert all(r.accepted for r in results)
    assert (results[0].staleness, results[1].staleness) == (0, 6)
    assert results[1].weight < results[0].weight


def test_a_member_signing_counters_no_honest_replica_has_is_refused() -> None:
    assert _refusal(_update(IDS[:2], stale=[(5, 4), (5, 5)])) == "group_bad_counters"


def test_listeners_hear_of_each_group_update_applied_once() -> None:
    pipeline, heard = _pipeline(), list[GroupUpdate]()
    pipeline.groups.on_applied.append(heard.append)
    update = _update(IDS[:2])
    in_group = member_check(RUN, update.head.group_key)
    assert pipeline.submit_group(update, in_group).accepted
    assert not pipeline.submit_group(update, in_group).accepted  # a duplicate: not heard again
    assert not pipeline.submit_group(_update(IDS[:2]), lambda peer: False).accepted
    assert heard == [update]


def test_a_second_variant_of_a_group_id_is_counted_as_equivocation_of_who_cosigned_both() -> None:
    """Two complete updates of one round with other included sets (members co-signing two
    sets): the replica keeps the first, counts the second as equivocation, not a duplicate."""
    pipeline = _pipeline()
    first, second = _update(IDS[:3]), _update(IDS[:2])
    in_group = member_check(RUN, first.head.group_key)
    assert pipeline.submit_group(first, in_group).accepted
    before = pipeline.replica.params.clone()
    assert pipeline.submit_group(first, in_group).reason == "duplicate"
    assert pipeline.submit_group(second, in_group).reason == "group_equivocation"
    assert torch.equal(pipeline.replica.params, before)
    both = tuple(sorted(m.peer_id for m in IDS[:2]))
    variants = pipeline.groups.variants
    assert variants.equivocators(("groups.0b", 3), *variant_of(second)) == both
    assert pipeline.rejections["group_equivocation"] == 1


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), min_size=3, max_size=3))
def test_one_member_moves_the_groups_staleness_no_further_than_the_others_claims(
    claims: list[tuple[int, int]],
) -> None:
    """Whatever one member signs (here the last), the group's staleness stays within what the
    others signed: between the lowest and the highest of their stalenesses."""
    stale = [(base, base + extra) for base, extra in claims]
    others = sorted(published - base for base, published in stale[:2])
    for lie in ((0, 0), (0, 10_000), stale[2]):
        update = _update(IDS[:3], stale=[*stale[:2], lie])
        assert others[0] <= update.staleness <= others[1]
        assert update.update_header(FINGERPRINT, 10).staleness == update.staleness


def test_a_realignment_merges_a_retained_group_update_the_donor_lacked_again() -> None:
    """dht.realign.merge_retained: a group update this node applied and retained, which the
    donor it realigns to had not, is merged again from its wire bytes after the adopt, as
    one unit; once the donor applies it too, both hold one applied set and one point."""
    from dht.gossip_groups import group_update_id
    from dht.grouping_wire import encode_update
    from dht.realign import lacking_retained, merge_retained
    from dht.retention import RetainedUpdates

    update = _update(IDS[:3])
    node, donor = _pipeline(), _pipeline()
    in_group = member_check(RUN, update.head.group_key)
    assert node.submit_group(update, in_group).accepted
    retained = RetainedUpdates(per_author=8, budget_bytes=1 << 20)
    retained.put(group_update_id(update), encode_update(update))
    retained.put((update.head.group_key, 9), b"DGU1 junk")  # never expected: skipped, logged
    node.adopt(donor.transfer_state())
    assert lacking_retained(retained, node.replica)[0] == group_update_id(update)
    results = merge_retained(retained, node)
    assert [(r.author, r.seq, r.accepted) for r in results] == [(group_key(""), 3, True)]
    assert merge_retained(retained, node) == []
    assert donor.submit_group(update, in_group).accepted
    assert node.replica.applied_digest() == donor.replica.applied_digest()
    assert torch.equal(node.replica.params, donor.replica.params)
