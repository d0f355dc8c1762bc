"""The norm cap of group updates decided by their signed norm bound (merge.group_update.
signed_norm_bound) on both paths: a replica holding a round's updates whole
(`GroupMerge.submit`) and a group deciding the round from its members' per-part figures
(merge.shard_round) refuse exactly the same updates, whatever one member of the receiving
group reports of its slice; the bound bounds every honest aggregate."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import group_key
from merge.group_chunks import aligned_bounds
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
from merge.shard_round import CapUndecided, ShardRound, part_gram, state_tensors, summed_gram
from merge.shard_round_cap import CapBound
from tests.unit.shard_round_paths import (
    NUMEL,
    RUN,
    Spec,
    _everyone,
    _note,
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
    pipeline: UpdatePipeline,
    updates: Sequence[GroupUpdate],
    liar: int,
    factor: float,
    until_fold: bool = False,
) -> list[MergeResult]:
    """The round by three members' parts, member `liar` reporting its slice of every update
    times `factor` (consistently: its part Gram matrix and its slices of the sums alike, so
    every check a receiver makes of them passes)."""
    rounds, incoming = _ordered(pipeline, updates)
    results: list[MergeResult] = []
    while incoming:  # the updates a round defers (an undecided cap) are the next round's
        states = state_tensors(pipeline.replica)
        bounds = aligned_bounds(NUMEL, 3)
        shards = [_shards(incoming, s, e) for s, e in bounds]
        shards[liar] = [x * factor for x in shards[liar]]
        grams = [part_gram([t[s:e] for t in states] + shards[m]) for m, (s, e) in enumerate(bounds)]
        try:
            plan = rounds.decide(incoming, summed_gram(grams), until_fold=until_fold)
        except CapUndecided:  # the wiring's fall back: the round fetched whole, one by one
            _note("cap undecided: fetched whole")
            return results + _one_by_one(pipeline, [i.update for i in incoming if i.update])
        slices = [ShardRound.weighted_sums(plan, shards[m]) for m in range(3)]
        gathered = [torch.cat([member[k] for member in slices]) for k in range(len(plan.combos))]
        results += rounds.apply(plan, gathered)
        incoming = list(plan.deferred)
    return results


def _refusals(results: Sequence[MergeResult]) -> list[tuple[str, int, bool, str | None]]:
    return [(r.author, r.seq, r.accepted, None if r.accepted else r.reason) for r in results]


def _over_cap(pipeline: UpdatePipeline, group: int, where: int, over: float) -> GroupUpdate:
    """A one-member group's update `over` times the cap, all of it in the slice of member
    `where` of three: the slice a liar there reports as it likes."""
    cap = pipeline.config.max_update_norm_ratio * float(pipeline.replica.params.norm())
    start, end = aligned_bounds(NUMEL, 3)[where]
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
    until_fold=st.booleans(),
)
def test_both_paths_refuse_the_same_updates_whatever_a_member_reports(
    kind: OuterKind,
    history: list[Spec],
    batch: list[Spec],
    over: list[tuple[int, float]],
    liar: int,
    factor: float,
    seed: int,
    until_fold: bool,
) -> None:
    """A member under-reporting its slices (to 0) cannot bring an update over the cap (5 to
    50 % over it, held in any member's slice; or 4x over it, spread) into its group's
    applied set: the round path refuses what the whole path refuses, and applies what it
    applies. Groups claiming one learner too (a whole outer step before the floor has
    votes: the params' norm later caps read moves by it), rounds cut at a fold or not; a
    round whose cap is undecided is fetched whole (the wiring's fall back)."""
    whole, parts = _pipeline(kind), _pipeline(kind)
    for spec in history:
        update = _update(spec, seed, 16)
        whole.submit_group(update, _everyone)
        parts.submit_group(update, _everyone)
    updates = [_update(spec, seed + 1, 16) for spec in batch]
    updates += [_over_cap(whole, 6 + i, where, x) for i, (where, x) in enumerate(over)]
    if not updates:
        return
    expected = _one_by_one(whole, updates)
    results = _lied_round(parts, updates, liar, factor, until_fold)
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


def _whole_step_then_near_cap(pipeline: UpdatePipeline, over: float) -> list[GroupUpdate]:
    """A first update claiming one learner (no votes on the floor yet: a whole outer step,
    a fold) that lengthens the params by ~15 %, then one `over` x the cap at the round's
    start: under the cap after the first update, over it before."""
    params = pipeline.replica.params
    first = _group_update([-2.0 * params / params.norm()], group=0, learners=1)
    cap = pipeline.config.max_update_norm_ratio * float(params.norm())
    second = _group_update([torch.linspace(0.5, 1.5, NUMEL) * 0 + cap * over / NUMEL**0.5], 6)
    return [first, second]


def test_a_member_deflating_a_whole_step_cannot_move_the_cap_of_a_later_update() -> None:
    """Hypothesis' case: the round's first update takes a whole outer step; a member
    reporting its slices of it as zero made the params look shorter, and the round path
    refused an update the whole path applies (or the other way round). The cap of the later
    update is not decided by what every member checks: the round is fetched whole, and both
    paths apply the same set whichever member lies, by whatever factor."""
    updates = _whole_step_then_near_cap(_pipeline("delayed_nesterov"), 1.12)
    expected = _one_by_one(_pipeline("delayed_nesterov"), updates)
    assert [r.accepted for r in expected] == [True, True]  # under the cap after the step
    for liar in range(3):
        for factor in (0.0, 0.3, 1.0):
            parts = _pipeline("delayed_nesterov")
            rounds, incoming = _ordered(parts, updates)
            states = state_tensors(parts.replica)
            gram = summed_gram(
                [part_gram([t[s:e] for t in states] + _shards(incoming, s, e))
                 for s, e in aligned_bounds(NUMEL, 3)]
            )  # fmt: skip
            with pytest.raises(CapUndecided):
                rounds.decide(incoming, gram)
            results = _lied_round(parts, updates, liar, factor)
            assert _refusals(results) == _refusals(expected)
            assert parts.replica.applied == _pipeline_after(updates).replica.applied


def _pipeline_after(updates: Sequence[GroupUpdate]) -> UpdatePipeline:
    whole = _pipeline("delayed_nesterov")
    _one_by_one(whole, updates)
    return whole


def test_a_round_far_from_the_cap_is_decided_by_parts() -> None:
    """The fall back is for updates near the cap: honest rounds of updates far under it
    (a few % of the params' norm, as in training), groups claiming one learner included,
    are decided by parts, on both optimizers."""
    for kind in ("nesterov", "delayed_nesterov"):
        pipeline = _pipeline(kind)  # type: ignore[arg-type]
        specs_ = [Spec(g, 0, "honest", 0, 0, low=g % 2 == 0) for g in range(6)]
        updates = [_update(s, 7, 4) for s in specs_]
        rounds, incoming = _ordered(pipeline, updates)
        states = state_tensors(pipeline.replica)
        gram = summed_gram(
            [part_gram([t[s:e] for t in states] + _shards(incoming, s, e))
             for s, e in aligned_bounds(NUMEL, 3)]
        )  # fmt: skip
        plan = rounds.decide(incoming, gram)
        assert len(plan.decisions) == 6 and not plan.deferred


@settings(max_examples=100, deadline=None)
@given(
    kind=st.sampled_from(["nesterov", "delayed_nesterov"]),
    learners=st.sampled_from([1, 2, 3, 16]),
    history=st.lists(specs, max_size=6),
    batch=st.lists(specs, min_size=1, max_size=8),
    seed=st.integers(0, 2**20),
)
def test_the_cap_bound_holds_what_the_whole_path_does(
    kind: OuterKind, learners: int, history: list[Spec], batch: list[Spec], seed: int
) -> None:
    """`CapBound` fed with the headers alone bounds how far the params moved through any
    batch applied whole (clipped, recentred, zeroed, folded, floor-sized updates), and each
    cap it decides is the whole path's."""
    whole = _pipeline(kind)
    for spec in history:
        whole.submit_group(_update(spec, seed, learners), _everyone)
    start = whole.replica.params.clone()
    bound = CapBound(
        whole, whole.replica.outer, [float(t.norm()) for t in state_tensors(whole.replica)]
    )
    updates = sorted(
        (_update(spec, seed + 1, learners) for spec in batch),
        key=lambda u: (u.head.group_key, u.seq),
    )
    for update in updates:
        moved = float((whole.replica.params - start).norm())
        assert moved <= bound.displacement() * (1 + 1e-5) + 1e-6
        norm_bound = signed_norm_bound(update, ReductionConfig())
        cap = bound.decide(norm_bound, 1e-12)
        result = whole.submit_group(update, _everyone)
        if result.reason in ("too_stale", "group_bad_learners", "duplicate", "group_equivocation"):
            continue
        assert cap != "refuse" or result.reason == "norm_too_large"
        assert cap != "admit" or result.accepted
        if result.accepted:
            header = update.update_header(whole.fingerprint, whole.config.max_inner_steps)
            bound.step(header, update.head.learners, norm_bound)


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(["nesterov", "delayed_nesterov"]),
    step=st.one_of(st.floats(-0.4, -0.02), st.floats(0.02, 0.4)),
    over=st.floats(0.7, 1.4),
    liar=st.integers(0, 2),
    factor=st.sampled_from([0.0, 0.3, 1.0]),
    until_fold=st.booleans(),
)
def test_after_a_whole_step_both_paths_apply_the_same_set_whatever_a_member_reports(
    kind: OuterKind, step: float, over: float, liar: int, factor: float, until_fold: bool
) -> None:
    """The case the cap bound is for, drawn: a first update claiming one learner that moves
    the params along themselves by up to 40 % either way (a whole outer step), then one
    0.7-1.4x the cap at the round's start, one member reporting its slices of both scaled
    by `factor`. Both paths apply the same set (on the code before the bound, a liar at 0 or
    0.3 made the round refuse what the whole path applied)."""
    whole, parts = _pipeline(kind), _pipeline(kind)
    params = whole.replica.params
    first = _group_update([-step / 0.6 * params], group=0, learners=1)
    cap = whole.config.max_update_norm_ratio * float(params.norm())
    second = _group_update([torch.full((NUMEL,), cap * over / NUMEL**0.5)], group=6)
    expected = _one_by_one(whole, [first, second])
    results = _lied_round(parts, [first, second], liar, factor, until_fold)
    assert _refusals(results) == _refusals(expected)
    assert parts.replica.applied == whole.replica.applied
