"""The norm cap of group updates decided by their signed norm bound (merge.group_update.
signed_norm_bound) on both paths: a replica holding a round's updates whole
(`GroupMerge.submit`) and a group deciding the round from its members' per-part figures
(merge.shard_round) refuse exactly the same updates, whatever one member of the receiving
group reports of its slice; the bound bounds every honest aggregate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import group_key
from merge.group_plan import shard_bounds
from merge.group_update import (
    NORM_BOUND_SLACK,
    ContributionHeader,
    GroupReduction,
    GroupUpdate,
    ReductionConfig,
    RoundFields,
    signed_norm_bound,
)
from merge.identity import Identity
from merge.outer import OuterKind
from merge.pipeline import UpdatePipeline
from merge.result import MergeResult
from merge.shard_round import ShardRound, part_gram, state_tensors, summed_gram
from tests.unit.test_shard_round import (
    NUMEL,
    RUN,
    Spec,
    _everyone,
    _one_by_one,
    _ordered,
    _pipeline,
    _shards,
    _update,
    specs,
)

MEMBERS = [Identity.generate() for _ in range(8)]


def _group_update(tensors: Sequence[torch.Tensor], group: int, learners: int = 16) -> GroupUpdate:
    """A group of len(tensors) members' update for round 0 (the reduction clips and means)."""
    ids = MEMBERS[: len(tensors)]
    key = group_key(format(group, "b"))
    members = [i.peer_id for i in ids]
    reduction = GroupReduction(group_key=key, epoch=0, round=0, members=members)
    fields = RoundFields(
        run_id=RUN, group_key=key, epoch=0, round=0, learners=learners,
        base_applied=10, published_applied=10,
    )  # fmt: skip
    for member, tensor in zip(ids, tensors, strict=True):
        assert reduction.contribute(ContributionHeader.of(tensor, member, fields, 500), tensor)
    reduction.close()
    for member in ids:
        reduction.cosign(member.peer_id, member.sign(reduction.statement(member.peer_id)))
    assert isinstance(reduction.outcome, GroupUpdate)
    return reduction.outcome


def _lied_round(
    pipeline: UpdatePipeline, updates: Sequence[GroupUpdate], liar: int, factor: float
) -> list[MergeResult]:
    """The round by three members' parts, member `liar` reporting its slice of every update
    times `factor` (consistently: its part Gram matrix and its slices of the sums alike, so
    every check a receiver makes of them passes)."""
    rounds, incoming = _ordered(pipeline, updates)
    states = state_tensors(pipeline.replica)
    bounds = shard_bounds(NUMEL, 3)
    shards = [_shards(incoming, s, e) for s, e in bounds]
    shards[liar] = [x * factor for x in shards[liar]]
    grams = [part_gram([t[s:e] for t in states] + shards[m]) for m, (s, e) in enumerate(bounds)]
    plan = rounds.decide(incoming, summed_gram(grams))
    slices = [ShardRound.weighted_sums(plan, shards[m]) for m in range(3)]
    gathered = [torch.cat([member[k] for member in slices]) for k in range(len(plan.combos))]
    return rounds.apply(plan, gathered)


def _refusals(results: Sequence[MergeResult]) -> list[tuple[str, int, bool, str | None]]:
    return [(r.author, r.seq, r.accepted, None if r.accepted else r.reason) for r in results]


def _over_cap(pipeline: UpdatePipeline, group: int, where: int, over: float) -> GroupUpdate:
    """A one-member group's update `over` times the cap, all of it in the slice of member
    `where` of three: the slice a liar there reports as it likes."""
    cap = pipeline.config.max_update_norm_ratio * float(pipeline.replica.params.norm())
    start, end = shard_bounds(NUMEL, 3)[where]
    tensor = torch.zeros(NUMEL)
    tensor[start:end] = torch.linspace(0.5, 1.5, end - start)
    return _group_update([tensor / tensor.norm() * cap * over], group=group)


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from(["nesterov", "delayed_nesterov"]),
    history=st.lists(specs, max_size=5),
    batch=st.lists(specs, max_size=5),
    over=st.lists(st.tuples(st.integers(0, 2), st.floats(1.05, 1.5)), max_size=2),
    liar=st.integers(0, 2),
    factor=st.sampled_from([0.0, 0.01, 0.3, 1.0]),
    seed=st.integers(0, 2**20),
)
def test_both_paths_refuse_the_same_updates_whatever_a_member_reports(
    kind: OuterKind,
    history: list[Spec],
    batch: list[Spec],
    over: list[tuple[int, float]],
    liar: int,
    factor: float,
    seed: int,
) -> None:
    """A member under-reporting its slices (to 0) cannot bring an update over the cap (5 to
    50 % over it, held in any member's slice; or 4x over it, spread) into its group's
    applied set: the round path refuses what the whole path refuses, and applies what it
    applies."""
    whole, parts = _pipeline(kind), _pipeline(kind)
    for spec in history:
        update = _update(spec, seed, 16)
        whole.submit_group(update, _everyone)
        parts.submit_group(update, _everyone)
    # Low claims in the history only: a batch's first update claiming one learner with no
    # votes yet in the floor takes a whole outer step, and the params' norm the cap reads
    # after it is replayed from the members' slices (a member deflating them moves it: a
    # known limit of the sharded round's cap, docs/scale.md wiring plan step 5).
    updates = [_update(replace(spec, low=False), seed + 1, 16) for spec in batch]
    updates += [_over_cap(whole, 6 + i, where, x) for i, (where, x) in enumerate(over)]
    if not updates:
        return
    expected = _one_by_one(whole, updates)
    results = _lied_round(parts, updates, liar, factor)
    assert _refusals(results) == _refusals(expected)
    assert parts.replica.applied == whole.replica.applied
    assert [r.learners for r in results] == [r.learners for r in expected]
    assert parts.learner_floor.state_dict() == whole.learner_floor.state_dict()


def test_an_update_over_the_cap_deflated_by_a_member_is_refused_by_its_group() -> None:
    """The case the bound closes: an update 20 % over the cap, all of it in one member's
    slice, that member reporting it as zero (its group's matrix then holds the update as
    empty). Refused on both paths, whichever member lies."""
    whole = _pipeline("delayed_nesterov")
    honest = [_update(Spec(g, 0, "honest", 0, 0), 3, 16) for g in range(2)]
    for where in range(3):
        updates = [*honest, _over_cap(whole, 6, where, 1.2)]
        expected = _one_by_one(_pipeline("delayed_nesterov"), updates)
        assert [r.reason for r in expected if not r.accepted] == ["norm_too_large"]
        for liar in range(3):
            results = _lied_round(_pipeline("delayed_nesterov"), updates, liar, 0.0)
            assert _refusals(results) == _refusals(expected)


def test_an_honest_update_under_the_cap_with_its_bound_over_it_is_refused_on_both() -> None:
    """Two members whose pseudo-gradients nearly cancel: the aggregate is far under the cap,
    its signed bound (the mean of the members' norms) over it. Both paths refuse it
    (`norm_too_large`): the cap reads signed data only."""
    whole, parts = _pipeline("delayed_nesterov"), _pipeline("delayed_nesterov")
    cap = whole.config.max_update_norm_ratio * float(whole.replica.params.norm())
    big = torch.linspace(-1.0, 1.0, NUMEL)
    big = big / big.norm() * cap * 1.5
    small = torch.linspace(0.0, 1.0, NUMEL) * 0.01
    update = _group_update([big, -big + small], group=2)
    assert float(update.aggregate.norm()) < 0.01 * cap
    assert signed_norm_bound(update, ReductionConfig()) > cap
    honest = _update(Spec(0, 0, "honest", 0, 0), 5, 16)
    expected = _one_by_one(whole, [honest, update])
    results = _lied_round(parts, [honest, update], 0, 1.0)
    refused = [(r.author, r.reason) for r in expected if not r.accepted]
    assert refused == [(update.head.group_key, "norm_too_large")]
    assert _refusals(results) == _refusals(expected)
    assert parts.replica.applied == whole.replica.applied


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(1, 8),
    scales=st.lists(st.sampled_from([0.0, 0.1, 1.0, 1.0, 1.0, 10.0, 1000.0]), min_size=8),
    along=st.floats(0.0, 1.0),
    bf16=st.booleans(),
    seed=st.integers(0, 2**20),
)
def test_the_signed_bound_bounds_every_honest_aggregate(
    size: int, scales: list[float], along: float, bf16: bool, seed: int
) -> None:
    """Any members' pseudo-gradients (outliers clipped by the reduction, parts sent in bf16,
    correlated or not): the aggregate's norm is at most the signed bound, so an honest group
    never sees its members' per-part figures refused as longer than they signed."""
    generator = torch.Generator().manual_seed(seed)
    common = torch.randn(NUMEL, generator=generator)
    tensors = []
    for scale in scales[:size]:
        noise = torch.randn(NUMEL, generator=generator)
        tensor = scale * (along * common + (1 - along) * noise)
        tensors.append(tensor.to(torch.bfloat16).to(torch.float32) if bf16 else tensor)
    update = _group_update(tensors, group=3)
    bound = signed_norm_bound(update, ReductionConfig())
    assert float(update.aggregate.norm()) <= bound
    assert math.isfinite(bound) and bound <= NORM_BOUND_SLACK * max(
        float(t.norm()) for t in tensors
    )
