"""A round of other groups' updates merged as one linear step (merge.shard_round): from the
members' per-part Gram matrices and weighted sums, the replica ends where applying the
updates one by one through `GroupMerge.submit` in id order leaves it (params and momentum
within float rounding; the applied set, the co-signer ledger, the robust window, the
variants and the counters alike). The checks of a member's part: test_shard_round_checks.py;
the two paths: shard_round_paths.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.outer import OuterKind
from merge.shard_round import summed_gram
from tests.unit.shard_round_paths import (
    Spec,
    _assert_alike,
    _by_shards,
    _everyone,
    _gathered,
    _grams,
    _one_by_one,
    _ordered,
    _pipeline,
    _update,
    specs,
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
