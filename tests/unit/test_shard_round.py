"""A round of other groups' updates merged as one linear step (merge.shard_round): from the
members' per-part Gram matrices and weighted sums, the replica ends where applying the
updates one by one through `GroupMerge.submit` in id order leaves it (params and momentum
within float rounding; the applied set, the co-signer ledger, the robust window, the
variants and the counters alike), and one dishonest member moves the round's step no more
than the robust norm bound lets the round's updates move it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from dht.grouping import group_key
from merge.group_plan import shard_bounds
from merge.group_update import ContributionHeader, GroupReduction, GroupUpdate, RoundFields
from merge.identity import Identity
from merge.outer import OuterConfig, OuterKind, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.shard_round import (
    CapUndecided,
    Incoming,
    RoundPlan,
    ShardRound,
    gram_problem,
    overlapping,
    part_gram,
    part_problem,
    round_problem,
    state_tensors,
    summed_gram,
    sums_problem,
)
from merge.weighting import StalenessConfig, TokenWeightConfig
from tests.factories import FINGERPRINT

RUN = "run-shard-round"
NUMEL = 30
IDS = [Identity.generate() for _ in range(6)]
DIRECTION = torch.linspace(-1.0, 1.0, NUMEL) / torch.linspace(-1.0, 1.0, NUMEL).norm()


def _everyone(peer: str) -> bool:
    return True


def _pipeline(kind: OuterKind) -> UpdatePipeline:
    config = MergeConfig(
        outer=OuterConfig(kind=kind, lr=0.7, momentum=0.9),
        staleness=StalenessConfig(kind="polynomial", a=0.5),
        token_weight=TokenWeightConfig(reference_tokens=1000),
        max_inner_steps=100,
        max_tokens_per_step=100,
    )
    start = torch.linspace(1.0, 2.0, NUMEL)
    replica = Replica(start, make_outer_optimizer(config.outer, NUMEL))
    pipeline = UpdatePipeline(replica, config, FINGERPRINT)
    pipeline.run_id = RUN
    return pipeline


@dataclass(frozen=True)
class Spec:
    group: int
    round: int
    kind: str
    """honest, big (an off-center size), outlier, huge (over the params norm cap), against."""
    variant: int
    staleness: int
    low: bool = False
    """Its group claims one learner whatever the others claim (sized by the learner floor)."""


def _tensor(spec: Spec, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1000 + spec.group * 50 + spec.round * 5)
    noise = torch.randn(NUMEL, generator=generator) / NUMEL**0.5
    honest = 0.3 * (DIRECTION + 0.5 * noise + 0.01 * spec.variant)
    size = {"honest": 1.0, "big": 3.0, "outlier": 10.0, "huge": 100.0, "against": -1.5}
    return (honest if spec.kind != "against" else 0.3 * DIRECTION) * size[spec.kind]


def _update(spec: Spec, seed: int, learners: int) -> GroupUpdate:
    """A one-member group's update of `spec` (its aggregate: the member's part), claiming
    `learners` (one if `spec.low`)."""
    member = IDS[spec.group]
    key = group_key(format(spec.group, "b"))
    reduction = GroupReduction(group_key=key, epoch=0, round=spec.round, members=[member.peer_id])
    fields = RoundFields(
        run_id=RUN, group_key=key, epoch=0, round=spec.round, learners=1 if spec.low else learners,
        base_applied=10, published_applied=10 + spec.staleness,
    )  # fmt: skip
    tensor = _tensor(spec, seed)
    reduction.contribute(ContributionHeader.of(tensor, member, fields, 500), tensor)
    reduction.close()
    reduction.cosign(member.peer_id, member.sign(reduction.statement(member.peer_id)))
    assert isinstance(reduction.outcome, GroupUpdate)
    return reduction.outcome


def _ordered(
    pipeline: UpdatePipeline, updates: Sequence[GroupUpdate]
) -> tuple[ShardRound, list[Incoming]]:
    """The round's merge for `pipeline` and `updates` as it orders them (ids in order)."""
    rounds = ShardRound(pipeline.groups)
    return rounds, rounds.order([Incoming.of(pipeline.groups, u, _everyone) for u in updates])


def _shards(incoming: Sequence[Incoming], start: int, end: int) -> list[torch.Tensor]:
    """One member's slice of each update (zeros for one refused before its tensor is read:
    in the shard path its shards are not fetched)."""
    out = []
    for inc in incoming:
        update = inc.update
        ok = inc.problem is None and update is not None and update.aggregate.numel() == NUMEL
        out.append(update.aggregate[start:end] if ok and update else torch.zeros(end - start))
    return out


def _grams(
    pipeline: UpdatePipeline, incoming: Sequence[Incoming], members: int
) -> list[list[list[float]]]:
    states = state_tensors(pipeline.replica)
    return [
        part_gram([t[s:e] for t in states] + _shards(incoming, s, e))
        for s, e in shard_bounds(NUMEL, members)
    ]


def _gathered(plan: RoundPlan, incoming: Sequence[Incoming], members: int) -> list[torch.Tensor]:
    """The all-gather: each member's slice of each combo, joined."""
    slices = [
        ShardRound.weighted_sums(plan, _shards(incoming, s, e))
        for s, e in shard_bounds(NUMEL, members)
    ]
    return [torch.cat([member[k] for member in slices]) for k in range(len(plan.combos))]


def _by_shards(
    pipeline: UpdatePipeline,
    updates: Sequence[GroupUpdate],
    members: int,
    until_fold: bool = False,
) -> tuple[list, RoundPlan | None]:
    """The round by parts; ``until_fold``: in as many rounds as its folds make, each taking
    the one before's deferred updates (the results of all, the last round's plan; None when
    a round's norm cap was undecided and the rest was applied one by one)."""
    rounds, incoming = _ordered(pipeline, updates)
    results = []
    while True:
        gram = summed_gram(_grams(pipeline, incoming, members))
        try:
            plan = rounds.decide(incoming, gram, until_fold=until_fold)
        except CapUndecided:  # the wiring's fall back: the round fetched whole, one by one
            _note("cap undecided: fetched whole")
            rest = [inc.update for inc in incoming if inc.update is not None]
            return results + _one_by_one(pipeline, rest), None
        results += rounds.apply(plan, _gathered(plan, incoming, members))
        if not plan.deferred:
            return results, plan
        assert until_fold and len(plan.combos) == 1
        incoming = list(plan.deferred)


def _note(name: str) -> None:
    """A hypothesis event where a hypothesis test runs (its statistics count it)."""
    if currently_in_test_context():
        event(name)


def _one_by_one(pipeline: UpdatePipeline, updates: Sequence[GroupUpdate]) -> list:
    ordered = sorted(updates, key=lambda u: (u.head.group_key, u.seq))
    return [pipeline.submit_group(u, _everyone) for u in ordered]


def _outer_state(pipeline: UpdatePipeline) -> dict[str, object]:
    return pipeline.replica.outer.state_dict()


def _assert_alike(a: UpdatePipeline, b: UpdatePipeline) -> None:
    ra, rb = a.replica, b.replica
    assert ra.applied == rb.applied and ra.num_applied == rb.num_applied
    assert ra.progress == rb.progress
    assert ra.cosigned.counts() == rb.cosigned.counts()
    assert a.rejections == b.rejections and a.num_merged == b.num_merged
    assert a.groups.variants._applied == b.groups.variants._applied
    torch.testing.assert_close(ra.params, rb.params, rtol=1e-5, atol=1e-6)
    sa, sb = _outer_state(a), _outer_state(b)
    assert sa.keys() == sb.keys() and sa["count"] == sb["count"]
    for key in ("buf", "acc"):
        if key in sa:
            torch.testing.assert_close(sa[key], sb[key], rtol=1e-5, atol=1e-6)
    assert sa.get("progress") == sb.get("progress")
    assert a.learner_floor.state_dict() == b.learner_floor.state_dict()
    assert_ledgers_alike(a, b)  # the co-signers' budgets
    wa, wb = a.robust.state_dict(), b.robust.state_dict()
    assert wa["authors"] == wb["authors"] and wa["rounds"] == wb["rounds"]
    for x, y in zip(wa["norms"], wb["norms"], strict=True):  # type: ignore[call-overload]
        assert math.isclose(x, y, rel_tol=1e-5)


def assert_ledgers_alike(a: UpdatePipeline, b: UpdatePipeline) -> None:
    """The contribution ledgers hold the same accounts in the same order, their amounts
    equal up to float rounding (a record is earned by the update's substance, from its norm:
    read from the Gram matrix on one path and from the tensor on the other)."""
    la, lb = a.ledger.state_dict(), b.ledger.state_dict()
    assert math.isclose(la["total"], lb["total"], rel_tol=1e-6, abs_tol=1e-9)  # type: ignore[arg-type]
    rows_a, rows_b = la["accounts"], lb["accounts"]
    assert isinstance(rows_a, list) and isinstance(rows_b, list)
    assert [r[0] for r in rows_a] == [r[0] for r in rows_b]
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for x, y in zip(ra[1:], rb[1:], strict=True):
            assert math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-9)


specs = st.builds(
    Spec,
    group=st.integers(0, 5),
    round=st.integers(0, 2),
    kind=st.sampled_from(["honest"] * 3 + ["big"] * 2 + ["outlier"] * 2 + ["huge", "against"]),
    variant=st.integers(0, 1),
    staleness=st.sampled_from([0, 0, 0, 3, 3, 2000]),
    low=st.sampled_from([False] * 4 + [True]),
)


@settings(max_examples=150, deadline=None)
@given(
    kind=st.sampled_from(["nesterov", "delayed_nesterov"]),
    learners=st.sampled_from([1, 2, 3, 16]),
    history=st.lists(specs, max_size=8),
    batch=st.lists(specs, min_size=1, max_size=6),
    members=st.integers(1, 4),
    seed=st.integers(0, 2**20),
    until_fold=st.booleans(),
)
def test_a_round_applied_as_one_step_ends_as_applied_one_by_one(
    kind: OuterKind,
    learners: int,
    history: list[Spec],
    batch: list[Spec],
    members: int,
    seed: int,
    until_fold: bool,
) -> None:
    """Folds of the delayed momentum inside the round (learners 1-3), a Nesterov momentum
    stepped by every update, recentred, clipped and zeroed updates, refused ones (too stale,
    over the norm cap), duplicates and second variants of one id, groups claiming one learner
    (sized by the learner floor, which the round's earlier updates feed): alike, each update
    sized by the same count. Cut at each fold (``until_fold``, the rest deferred to the next
    round) as well: alike, one sum a round."""
    a, b = _pipeline(kind), _pipeline(kind)
    for spec in history:
        update = _update(spec, seed, learners)
        a.submit_group(update, _everyone)
        b.submit_group(update, _everyone)
    updates = [_update(spec, seed + 1, learners) for spec in batch]
    expected = _one_by_one(a, updates)
    results, plan = _by_shards(b, updates, members, until_fold)
    if until_fold and kind == "delayed_nesterov" and plan is not None:
        assert len(plan.combos) <= 1
    assert [(r.accepted, r.reason, r.author, r.seq, r.learners) for r in results] == [
        (r.accepted, r.reason, r.author, r.seq, r.learners) for r in expected
    ]
    for x, y in zip(results, expected, strict=True):
        assert math.isclose(x.weight, y.weight, rel_tol=1e-5, abs_tol=1e-9)
    assert plan is None or len(plan.combos) <= 3  # two unless a batch completes two rounds
    _assert_alike(a, b)


def test_a_round_without_a_fold_gathers_one_sum() -> None:
    """Delayed Nesterov, no round completed inside the batch: the params and the round sum
    move by multiples of one weighted sum, the momentum not at all: one all-gather of one
    slice per member."""
    pipeline = _pipeline("delayed_nesterov")
    updates = [_update(Spec(g, 0, "honest", 0, 0), 7, 16) for g in range(4)]
    results, plan = _by_shards(pipeline, updates, 3)
    assert all(r.accepted for r in results)
    assert len(plan.combos) == 1
    params, buf, acc = plan.formed
    assert buf.sums == (0.0,) and acc.sums == (1.0,)
    assert math.isclose(params.sums[0], -0.7)


def test_a_round_with_one_fold_gathers_two_sums() -> None:
    """One round completes inside the batch (4 updates of 3 learners): the shares before the
    fold go into the momentum, those after it stay in the round sum, and the params move by
    a combination of the two: two slices per member, not three."""
    a, b = _pipeline("delayed_nesterov"), _pipeline("delayed_nesterov")
    updates = [_update(Spec(g, 0, "honest", 0, 0), 7, 3) for g in range(4)]
    _one_by_one(a, updates)
    results, plan = _by_shards(b, updates, 3)
    assert all(r.accepted for r in results) and len(plan.combos) == 2
    _assert_alike(a, b)


def test_the_replica_moved_since_the_plan_refuses_it() -> None:
    pipeline = _pipeline("delayed_nesterov")
    updates = [_update(Spec(g, 0, "honest", 0, 0), 3, 4) for g in range(2)]
    rounds, incoming = _ordered(pipeline, updates)
    plan = rounds.decide(incoming, summed_gram(_grams(pipeline, incoming, 2)))
    pipeline.submit_group(_update(Spec(5, 1, "honest", 0, 0), 3, 4), _everyone)
    before = pipeline.replica.params.clone()
    with pytest.raises(ValueError, match="changed"):
        rounds.apply(plan, _gathered(plan, incoming, 2))
    assert torch.equal(pipeline.replica.params, before)


def test_a_gram_matrix_no_vectors_have_is_refused() -> None:
    good = part_gram([torch.randn(5) for _ in range(3)])
    assert gram_problem(good, 3) is None
    assert gram_problem(good, 4) == "gram_shape"
    assert gram_problem("x", 3) == "gram_shape"
    bad = [row[:] for row in good]
    bad[0][1] = bad[1][0] = 10 * math.sqrt(good[0][0] * good[1][1])
    assert gram_problem(bad, 3) == "gram_beyond_schwarz"
    bad = [row[:] for row in good]
    bad[0][1] += 1.0
    assert gram_problem(bad, 3) == "gram_asymmetric"
    bad = [row[:] for row in good]
    bad[2][2] = -1.0
    assert gram_problem(bad, 3) == "gram_negative_norm"
    bad = [row[:] for row in good]
    bad[1][1] = float("nan")
    assert gram_problem(bad, 3) == "gram_not_finite"


def _history(pipeline: UpdatePipeline, seed: int) -> None:
    """Warm: the robust reference and a momentum (5 rounds of 16 learners: no fold yet)."""
    for g in range(5):
        pipeline.submit_group(_update(Spec(g, 0, "honest", 0, 0), seed, 16), _everyone)


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**20),
    size=st.sampled_from([0.01, 0.03, 0.1, 0.3, 1000.0]),
    along=st.floats(-2.0, 2.0),
    liar=st.integers(0, 2),
    batch=st.integers(1, 4),
)
def test_one_dishonest_member_moves_the_round_no_more_than_the_robust_bound(
    seed: int, size: float, along: float, liar: int, batch: int
) -> None:
    """A member that lies consistently (its part Gram and its slices computed from shards of
    its own making: every check passes but, when it claims more, the signed norms') moves
    the round's step by at most the robust norm bound of each update: |step| <= lr / M x sum
    of weight x k x reference norm, in the world it made as in the honest one (Delayed
    Nesterov, no fold in the round)."""
    honest, hostile = _pipeline("delayed_nesterov"), _pipeline("delayed_nesterov")
    _history(honest, seed)
    _history(hostile, seed)
    updates = [_update(Spec(g, 1, "honest", 0, 0), seed + 1, 16) for g in range(batch)]
    start = honest.replica.params.clone()
    _, plan = _by_shards(honest, updates, 3)
    rounds = ShardRound(hostile.groups)
    incoming = rounds.order([Incoming.of(hostile.groups, u, _everyone) for u in updates])
    bounds = shard_bounds(NUMEL, 3)
    generator = torch.Generator().manual_seed(seed)

    def shards(member: int) -> list[torch.Tensor]:
        s, e = bounds[member]
        if member != liar:
            return _shards(incoming, s, e)
        sum_slice = state_tensors(hostile.replica)[2][s:e]  # the round not folded yet
        direction = sum_slice / sum_slice.norm()
        return [
            size * (along * direction + torch.randn(e - s, generator=generator)) for _ in incoming
        ]

    states = state_tensors(hostile.replica)
    lies = [shards(m) for m in range(3)]
    grams = [part_gram([t[s:e] for t in states] + lies[m]) for m, (s, e) in enumerate(bounds)]
    for m, (s, e) in enumerate(bounds):  # every check a receiver makes of a part passes
        assert part_problem(grams[m], [t[s:e] for t in states], batch) is None
    problem = round_problem(incoming, summed_gram(grams), len(states))
    if problem is not None:  # longer than the members signed: the round is fetched whole
        assert problem == "gram_beyond_signed_norm"
        return
    lied = rounds.decide(incoming, summed_gram(grams))
    slices = [ShardRound.weighted_sums(lied, lies[m]) for m in range(3)]
    for m, (s, e) in enumerate(bounds):
        assert sums_problem(lied, grams[m], slices[m], [t[s:e] for t in states]) is None
    gathered = [torch.cat([member[k] for member in slices]) for k in range(len(lied.combos))]
    rounds.apply(lied, gathered)
    # No fold in either world (a zeroed update takes no share): the params moved by the step.
    assert min(lied.progress, plan.progress) >= 5 / 16

    def bound(p: RoundPlan) -> float:
        k = hostile.config.robust.max_norm_to_median
        return (
            sum(
                d.weight * k * (d.verdict.median_norm or 0.0)
                for d in p.decisions
                if d.verdict is not None
            )
            * 0.7
            / 16
        )

    moved = float((hostile.replica.params - start).norm())
    apart = float((hostile.replica.params - honest.replica.params).norm())
    assert moved <= bound(lied) * (1 + 1e-4) + 1e-6
    assert apart <= (bound(lied) + bound(plan)) * (1 + 1e-4) + 1e-6


def test_slices_that_do_not_match_the_reported_gram_are_refused() -> None:
    """A member whose slice is larger than its reported shards allow, or leans along the
    receiver's state more than they do (0.1 % and up: fp32 rounding's slack, session 24), is
    caught by `sums_problem`."""
    pipeline = _pipeline("delayed_nesterov")
    _history(pipeline, 1)
    updates = [_update(Spec(g, 1, "honest", 0, 0), 2, 16) for g in range(3)]
    rounds, incoming = _ordered(pipeline, updates)
    grams = _grams(pipeline, incoming, 3)
    plan = rounds.decide(incoming, summed_gram(grams))
    s, e = shard_bounds(NUMEL, 3)[1]
    states = [t[s:e] for t in state_tensors(pipeline.replica)]
    honest = ShardRound.weighted_sums(plan, _shards(incoming, s, e))
    assert sums_problem(plan, grams[1], honest, states) is None
    assert sums_problem(plan, grams[1], [x * 1.5 for x in honest], states) == "sums_norm"
    norm = float(honest[0].norm())
    along = states[2] / states[2].norm() * norm  # as long, along the round not folded yet
    assert sums_problem(plan, grams[1], [along], states) == "sums_direction"
    assert sums_problem(plan, grams[1], [honest[0][:-1]], states) == "sums_shape"
    for lean in (0.02, 0.005, 0.001):  # 2 %, 0.5 %, 0.1 % along the state: refused
        tilted = honest[0] + lean * norm * states[2] / states[2].norm()
        assert sums_problem(plan, grams[1], [tilted], states) in ("sums_norm", "sums_direction")
    narrow = [x.to(torch.bfloat16).to(torch.float32) for x in honest]  # sessions 20-23's wire
    assert not torch.equal(narrow[0], honest[0])
    assert sums_problem(plan, grams[1], narrow, states) is not None  # beyond fp32's slack


def test_a_part_claiming_an_update_longer_than_its_members_signed_is_refused() -> None:
    """A member inflating its part of an update's norm (to have its group clip it, or refuse
    it as over the cap) claims more than the members' signed norms allow."""
    pipeline = _pipeline("delayed_nesterov")
    updates = [_update(Spec(g, 0, "honest", 0, 0), 5, 16) for g in range(3)]
    rounds, incoming = _ordered(pipeline, updates)
    grams = _grams(pipeline, incoming, 3)
    num_states = len(state_tensors(pipeline.replica))
    assert round_problem(incoming, summed_gram(grams), num_states) is None
    s, e = shard_bounds(NUMEL, 3)[2]
    shards = _shards(incoming, s, e)
    shards[1] = shards[1] * 4
    grams[2] = part_gram([t[s:e] for t in state_tensors(pipeline.replica)] + shards)
    problem = round_problem(incoming, summed_gram(grams), num_states)
    assert problem == "gram_beyond_signed_norm"
    with pytest.raises(ValueError, match="gram_beyond_signed_norm"):
        rounds.decide(incoming, summed_gram(grams))


@given(numel=st.integers(0, 500), ours=st.integers(1, 40), theirs=st.integers(1, 40))
def test_each_slice_fetches_the_shards_it_overlaps(numel: int, ours: int, theirs: int) -> None:
    """Every coordinate of a slice lies in a shard it fetches, and every shard it fetches
    holds one of them; with equal splits a slice fetches exactly its own shard."""
    bounds = shard_bounds(numel, theirs)
    for start, end in shard_bounds(numel, ours):
        fetched = overlapping(bounds, start, end)
        covered = {i for k in fetched for i in range(*bounds[k])}
        assert set(range(start, end)) <= covered
        assert all(set(range(*bounds[k])) & set(range(start, end)) for k in fetched)
        if ours == theirs and end > start:
            assert fetched == [shard_bounds(numel, ours).index((start, end))]


def test_a_part_misstating_the_state_is_refused() -> None:
    """Every member holds the state whole: a part claiming another norm of its slice of the
    params or the momentum is refused; an honest part (any member's) is taken."""
    pipeline = _pipeline("delayed_nesterov")
    _history(pipeline, 4)
    updates = [_update(Spec(g, 1, "honest", 0, 0), 4, 16) for g in range(2)]
    rounds, incoming = _ordered(pipeline, updates)
    grams = _grams(pipeline, incoming, 3)
    states = state_tensors(pipeline.replica)
    for part, (s, e) in zip(grams, shard_bounds(NUMEL, 3), strict=True):
        assert part_problem(part, [t[s:e] for t in states], 2) is None
    s, e = shard_bounds(NUMEL, 3)[0]
    lying = part_gram(
        [states[0][s:e], states[1][s:e], states[2][s:e] * 3] + _shards(incoming, s, e)
    )
    assert part_problem(lying, [t[s:e] for t in states], 2) == "gram_wrong_state"
    assert part_problem("x", [t[s:e] for t in states], 2) == "gram_shape"


def test_a_part_gram_in_chunks_is_the_whole_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked (float64 copies bounded) and exactly symmetric: the slices' dot products."""
    import merge.shard_round as shard_round

    monkeypatch.setattr(shard_round, "PART_CHUNK", 7)
    vectors = [torch.randn(50, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    gram = part_gram(vectors)
    assert gram_problem(gram, 4) is None
    for i in range(4):
        for j in range(4):
            exact = float(vectors[i].double() @ vectors[j].double())
            assert math.isclose(gram[i][j], exact, rel_tol=1e-12, abs_tol=1e-12)
