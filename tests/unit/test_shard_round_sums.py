"""A fetch round decided past its Delayed Nesterov folds (merge.shard_round_sums, `decide`'s
``until_fold`` and ``max_sums``; docs/scale.md, Session 27: second27): a plan never asks for
more than `max_sums` weighted sums, every update of the round is decided in it or deferred
(in id order, decided first), and applying the round's sums, then the deferred updates in the
rounds that take them, ends where applying them one by one does (within `SUMS_SLACK`)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.group_plan import shard_bounds
from merge.group_update import GroupUpdate
from merge.outer import OuterKind
from merge.pipeline import UpdatePipeline
from merge.shard_round import (
    MAX_SUMS,
    CapUndecided,
    Incoming,
    RoundPlan,
    ShardRound,
    state_tensors,
    summed_gram,
)
from merge.shard_round_checks import SUMS_SLACK, sums_problem
from merge.shard_round_sums import fold_limit, next_cut
from tests.unit.shard_round_paths import (
    NUMEL,
    Spec,
    _assert_alike,
    _everyone,
    _gathered,
    _grams,
    _history,
    _one_by_one,
    _ordered,
    _pipeline,
    _shards,
    _update,
    specs,
)


def test_the_fold_limit_reads_true_false_and_a_folds_number() -> None:
    assert fold_limit(True) == 1 and fold_limit(False) is None and fold_limit(2) == 2
    with pytest.raises(ValueError):
        fold_limit(0)


def test_a_plan_over_the_bound_is_cut_at_its_last_fold_then_the_one_before() -> None:
    assert next_cut(3, 3, 2, None) is None  # within: taken
    assert next_cut(3, 2, 2, None) == 2  # past its second fold: cut there
    assert next_cut(2, 1, 2, 2) == 1  # cut at its second: at the first
    assert next_cut(2, 1, 1, 3) == 1  # asked for a later fold than it took: its last
    with pytest.raises(ValueError):
        next_cut(2, 1, 0, None)  # no fold to cut at (a Nesterov round's two sums)
    with pytest.raises(ValueError):
        next_cut(2, 1, 1, 1)  # cut at the first already


def _rounds(
    pipeline: UpdatePipeline,
    updates: Sequence[GroupUpdate],
    members: int,
    until_fold: bool | int,
    max_sums: int,
) -> tuple[list, list[RoundPlan]]:
    """The updates by parts in as many rounds as the cuts make, each taking the one before's
    deferred updates; every plan checked against the bound and its members' sums against
    their parts (`sums_problem`). The results of all and the plans (an empty list of plans
    when a round's norm cap was undecided and the rest was applied one by one)."""
    rounds, incoming = _ordered(pipeline, updates)
    results: list = []
    plans: list[RoundPlan] = []
    while True:
        grams = _grams(pipeline, incoming, members)
        try:
            plan = rounds.decide(
                incoming, summed_gram(grams), until_fold=until_fold, max_sums=max_sums
            )
        except CapUndecided:
            rest = [inc.update for inc in incoming if inc.update is not None]
            return results + _one_by_one(pipeline, rest), []
        _check(plan, incoming, max_sums)
        states = state_tensors(pipeline.replica)
        for (s, e), part in zip(shard_bounds(NUMEL, members), grams, strict=True):
            sums = ShardRound.weighted_sums(plan, _shards(incoming, s, e))
            assert sums_problem(plan, part, sums, [t[s:e] for t in states]) is None
        results += rounds.apply(plan, _gathered(plan, incoming, members))
        plans.append(plan)
        if not plan.deferred:
            return results, plans
        incoming = list(plan.deferred)


def _check(plan: RoundPlan, incoming: Sequence[Incoming], max_sums: int) -> None:
    assert len(plan.combos) <= max_sums
    ordered = sorted(inc.uid for inc in incoming)
    decided = [d.incoming.uid for d in plan.decisions]
    assert decided + [inc.uid for inc in plan.deferred] == ordered  # each once, in id order
    assert plan.decisions or not plan.deferred  # a round decides at least one update


@settings(max_examples=120, deadline=None)
@given(
    learners=st.sampled_from([1, 2, 3]),
    history=st.lists(specs, max_size=4),
    batch=st.lists(specs, min_size=1, max_size=8),
    members=st.integers(1, 4),
    seed=st.integers(0, 2**20),
    until_fold=st.sampled_from([False, True, 2]),
    max_sums=st.integers(1, MAX_SUMS),
)
def test_a_round_past_its_folds_stays_within_the_bound_and_ends_as_one_by_one(
    learners: int,
    history: list[Spec],
    batch: list[Spec],
    members: int,
    seed: int,
    until_fold: bool | int,
    max_sums: int,
) -> None:
    """Delayed Nesterov with 1-3 learners (a fold every 1-3 updates: up to eight folds in a
    round), refused, recentred and clipped updates among them, any fold limit and any bound
    from one sum to `MAX_SUMS`: the plans never ask for more, each update is decided once,
    in a round or a later one, and the replica ends where one by one leaves it."""
    a, b = _pipeline("delayed_nesterov"), _pipeline("delayed_nesterov")
    for spec in history:
        update = _update(spec, seed, learners)
        a.submit_group(update, _everyone)
        b.submit_group(update, _everyone)
    updates = [_update(spec, seed + 1, learners) for spec in batch]
    expected = _one_by_one(a, updates)
    results, _ = _rounds(b, updates, members, until_fold, max_sums)
    assert [(r.accepted, r.reason, r.author, r.seq) for r in results] == [
        (r.accepted, r.reason, r.author, r.seq) for r in expected
    ]
    _assert_alike(a, b)  # params and momentum within rtol 1e-5 = SUMS_SLACK
    assert SUMS_SLACK == 1e-5


def _crossing_two_folds() -> tuple[UpdatePipeline, UpdatePipeline, list[GroupUpdate]]:
    """Five honest updates of two learners each: folds after the 2nd and the 4th."""
    a, b = _pipeline("delayed_nesterov"), _pipeline("delayed_nesterov")
    updates = [_update(Spec(g, 0, "honest", 0, 0), 7, 2) for g in range(5)]
    return a, b, updates


@pytest.mark.parametrize(
    ("max_sums", "sums", "rounds"), [(3, [3], 1), (2, [2, 1], 2), (1, [1, 1, 1], 3)]
)
def test_a_set_crossing_two_folds_gathers_three_sums_or_is_cut_to_the_bound(
    max_sums: int, sums: list[int], rounds: int
) -> None:
    """Past both folds: three sums, nothing deferred. Bounded by two: cut at the second fold
    (two sums), the fifth update the next round's. By one: cut at each fold (sessions 18-26's
    wiring)."""
    a, b, updates = _crossing_two_folds()
    _one_by_one(a, updates)
    results, plans = _rounds(b, updates, 3, False, max_sums)
    assert all(r.accepted for r in results)
    assert [len(p.combos) for p in plans] == sums and len(plans) == rounds
    _assert_alike(a, b)


def test_a_round_with_one_fold_gathers_two_sums_and_defers_nothing() -> None:
    """What the wiring asks since session 27 (`until_fold=False`): a fold inside takes one
    more sum instead of every member fetching the updates after it whole."""
    a, b = _pipeline("delayed_nesterov"), _pipeline("delayed_nesterov")
    updates = [_update(Spec(g, 0, "honest", 0, 0), 7, 3) for g in range(4)]
    _one_by_one(a, updates)
    results, plans = _rounds(b, updates, 3, False, MAX_SUMS)
    assert [len(p.combos) for p in plans] == [2] and not plans[0].deferred
    _assert_alike(a, b)
    cut_a, cut_b = _pipeline("delayed_nesterov"), _pipeline("delayed_nesterov")
    _one_by_one(cut_a, updates)
    _, cut = _rounds(cut_b, updates, 3, True, MAX_SUMS)  # sessions 18-26: one sum, one deferred
    assert [len(p.combos) for p in cut] == [1, 1] and len(cut[0].deferred) == 1
    _assert_alike(cut_a, cut_b)


@pytest.mark.parametrize("kind", ["nesterov", "delayed_nesterov"])
def test_no_optimizer_needs_more_than_max_sums_and_a_bound_below_its_need_is_a_bug(
    kind: OuterKind,
) -> None:
    """The sums are at most the optimizer's state tensors (three for Delayed Nesterov, two
    for Nesterov): `MAX_SUMS` never cuts a round of either. A bound below what a round
    without a fold needs (a Nesterov round's two) is the caller's error, never a peer's."""
    pipeline = _pipeline(kind)
    _history(pipeline, 2)
    updates = [_update(Spec(g, 1, "honest", 0, 0), 5, 2) for g in range(6)]  # three folds
    _, plans = _rounds(pipeline, updates, 2, False, MAX_SUMS)
    assert len(plans) == 1 and len(plans[0].combos) <= len(state_tensors(pipeline.replica))
    if kind == "nesterov":
        fresh = _pipeline(kind)
        _history(fresh, 2)
        rounds, incoming = _ordered(fresh, updates)
        gram = summed_gram(_grams(fresh, incoming, 2))
        with pytest.raises(ValueError, match="more than 1"):
            rounds.decide(incoming, gram, max_sums=1)
