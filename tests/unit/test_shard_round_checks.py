"""A member's part of a shard round checked (merge.shard_round): Gram matrices no vectors
have, slices that do not match the reported Gram, parts claiming more than the members signed
or misstating the state are refused; one dishonest member whose lies pass every check moves
the round's step no more than the robust norm bound lets the round's updates move it. Split
from test_shard_round.py in session 25."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.group_chunks import aligned_bounds
from merge.shard_round import (
    Incoming,
    RoundPlan,
    ShardRound,
    gram_problem,
    part_gram,
    part_problem,
    round_problem,
    state_tensors,
    summed_gram,
    sums_problem,
)
from tests.unit.shard_round_paths import (
    NUMEL,
    Spec,
    _by_shards,
    _everyone,
    _grams,
    _history,
    _ordered,
    _pipeline,
    _shards,
    _update,
)


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
    bounds = aligned_bounds(NUMEL, 3)
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
    s, e = aligned_bounds(NUMEL, 3)[1]
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
    s, e = aligned_bounds(NUMEL, 3)[2]
    shards = _shards(incoming, s, e)
    shards[1] = shards[1] * 4
    grams[2] = part_gram([t[s:e] for t in state_tensors(pipeline.replica)] + shards)
    problem = round_problem(incoming, summed_gram(grams), num_states)
    assert problem == "gram_beyond_signed_norm"
    with pytest.raises(ValueError, match="gram_beyond_signed_norm"):
        rounds.decide(incoming, summed_gram(grams))


def test_a_part_misstating_the_state_is_refused() -> None:
    """Every member holds the state whole: a part claiming another norm of its slice of the
    params or the momentum is refused; an honest part (any member's) is taken."""
    pipeline = _pipeline("delayed_nesterov")
    _history(pipeline, 4)
    updates = [_update(Spec(g, 1, "honest", 0, 0), 4, 16) for g in range(2)]
    rounds, incoming = _ordered(pipeline, updates)
    grams = _grams(pipeline, incoming, 3)
    states = state_tensors(pipeline.replica)
    for part, (s, e) in zip(grams, aligned_bounds(NUMEL, 3), strict=True):
        assert part_problem(part, [t[s:e] for t in states], 2) is None
    s, e = aligned_bounds(NUMEL, 3)[0]
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
