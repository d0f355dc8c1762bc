"""Robust merging and the pipeline's trust checks: hostile but well-signed updates are refused."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.envelope import SignedUpdate
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.robust import RobustConfig, RobustFilter
from merge.weighting import TokenWeightConfig
from tests.factories import FINGERPRINT, MALLORY, encoded, identity, sealed_update

HONEST = identity("h")
NUMEL = 64
CONFIG = MergeConfig(
    outer=OuterConfig(kind="nesterov", lr=0.1, momentum=0.9),
    token_weight=TokenWeightConfig(reference_tokens=1000),
    max_inner_steps=100,
    max_tokens_per_step=100,
)

DIRECTION = torch.linspace(-1, 1, NUMEL)


def make_pipeline() -> UpdatePipeline:
    params = torch.full((NUMEL,), 10.0)  # norm 80: honest updates of norm ~1 are ~1 %
    replica = Replica(params, make_outer_optimizer(CONFIG.outer, NUMEL))
    pipeline = UpdatePipeline(replica, CONFIG, FINGERPRINT)
    pipeline.clock = lambda: 1000.0
    return pipeline


def update(identity: Identity, seq: int, delta: torch.Tensor, **overrides: Any) -> SignedUpdate:
    fields: dict[str, Any] = dict(fingerprint=FINGERPRINT, numel=NUMEL, created_at=999.0)
    if not overrides.get("payload"):
        fields["payload"] = encoded(delta)
    return sealed_update(identity, seq=seq, **(fields | overrides))


def honest_delta(seed: int) -> torch.Tensor:
    """An honest pseudo-gradient: the training direction plus noise, norm ~1."""
    g = torch.Generator().manual_seed(seed)
    noisy = DIRECTION + 0.5 * torch.randn(NUMEL, generator=g) / NUMEL**0.5
    return noisy / DIRECTION.norm()


def warmed_up() -> UpdatePipeline:
    pipeline = make_pipeline()
    for seq in range(1, 9):
        assert pipeline.submit(update(HONEST, seq, honest_delta(seq))).accepted
    return pipeline


def test_a_near_cap_update_is_clipped_to_the_bound_relative_to_the_median_norm() -> None:
    pipeline, reference = warmed_up(), warmed_up()
    median = pipeline.robust.median_norm()
    assert median is not None
    big = honest_delta(99) * 20  # norm ~20: under the params-norm cap (80), 20x the honest ones
    bounded = big * (4.0 * median / float(big.norm()))  # the same direction at the bound

    result = pipeline.submit(update(MALLORY, 1, big))
    assert reference.submit(update(MALLORY, 1, bounded)).accepted

    assert result.accepted and result.robust == "norm_outlier"
    assert pipeline.rejections["norm_outlier"] == 1
    assert pipeline.replica.has_applied(MALLORY.peer_id, 1)  # one applied set everywhere
    torch.testing.assert_close(pipeline.replica.params, reference.replica.params)
    # A clipped outlier moves the median as an update at the bound would, no further (up to
    # the float32 rounding of the bounded update's norm: its author's vote is the reference).
    assert pipeline.robust.median_norm() == pytest.approx(reference.robust.median_norm(), rel=1e-6)


def test_a_well_scaled_update_against_the_momentum_contributes_nothing() -> None:
    pipeline = warmed_up()
    before = pipeline.replica.params.clone()

    result = pipeline.submit(update(MALLORY, 1, -honest_delta(99)))

    assert result.accepted and result.robust == "against_momentum" and result.weight == 0.0
    assert pipeline.rejections["against_momentum"] == 1
    assert pipeline.replica.has_applied(MALLORY.peer_id, 1)
    assert torch.equal(pipeline.replica.params, before)


@settings(max_examples=20, deadline=None)
@given(order=st.permutations(list(range(12))))
def test_replicas_with_different_histories_keep_one_applied_set(order: list[int]) -> None:
    """Verdicts depend on each replica's recent history; applied sets must not."""
    updates = [update(HONEST, seq, honest_delta(seq) * (1 + 3 * (seq % 4))) for seq in range(12)]
    updates += [update(MALLORY, 1, honest_delta(50) * 20), update(MALLORY, 2, -honest_delta(51))]
    first, second = make_pipeline(), make_pipeline()
    for u in updates:
        assert first.submit(u).accepted
    for i in [*order, 12, 13]:
        assert second.submit(updates[i]).accepted

    assert first.replica.applied_digest() == second.replica.applied_digest()


def test_honest_updates_pass_both_checks() -> None:
    pipeline = warmed_up()
    for seq in range(9, 30):
        result = pipeline.submit(update(HONEST, seq, honest_delta(seq) * (0.7 + 0.02 * seq)))
        assert result.accepted, result.reason


def test_during_warm_up_only_the_absolute_cap_applies() -> None:
    pipeline = make_pipeline()
    assert pipeline.submit(update(HONEST, 1, honest_delta(1) * 20)).accepted
    assert pipeline.robust.median_norm() is None


def test_a_second_payload_under_an_applied_id_is_equivocation() -> None:
    pipeline = make_pipeline()
    assert pipeline.submit(update(MALLORY, 1, honest_delta(1))).accepted
    same = pipeline.submit(update(MALLORY, 1, honest_delta(1)))
    other = pipeline.submit(update(MALLORY, 1, honest_delta(2)))

    assert same.reason == "duplicate"
    assert other.reason == "equivocation"
    assert pipeline.check_header(update(MALLORY, 1, honest_delta(3)).signed_header) == (
        "equivocation"
    )


def test_far_future_timestamps_and_seqs_are_refused_before_the_payload() -> None:
    pipeline = make_pipeline()
    ten_years = 10 * 365 * 86400.0
    future = update(MALLORY, 1, honest_delta(1), created_at=1000.0 + ten_years)
    far = update(MALLORY, 10**12, honest_delta(1))

    assert pipeline.check_header(future.signed_header) == "future_timestamp"
    assert pipeline.check_header(far.signed_header) == "seq_too_far"
    assert pipeline.submit(far).reason == "seq_too_far"
    assert pipeline.replica.num_applied == 0


def test_a_permissioned_pipeline_ignores_authors_outside_the_list() -> None:
    pipeline = make_pipeline()
    pipeline.admit = {HONEST.peer_id}.__contains__

    assert pipeline.submit(update(MALLORY, 1, honest_delta(1))).reason == "not_allowed"
    assert pipeline.submit(update(HONEST, 1, honest_delta(1))).accepted


@settings(max_examples=60, deadline=None)
@given(
    norms=st.lists(st.floats(0.1, 10.0), min_size=4, max_size=40),
    scale=st.floats(0.01, 100.0),
    order=st.randoms(use_true_random=False),
)
def test_verdicts_depend_on_the_accepted_norms_not_their_order(
    norms: list[float], scale: float, order: object
) -> None:
    """Replicas that accepted the same updates in another order judge the next one alike."""
    config = RobustConfig(window=64, warmup=4)
    first, second = RobustFilter(config), RobustFilter(config)
    shuffled = list(norms)
    order.shuffle(shuffled)  # type: ignore[attr-defined]
    for a, b in zip(norms, shuffled, strict=True):
        first.accepted(first.judge(torch.tensor([a]), None))
        second.accepted(second.judge(torch.tensor([b]), None))
    probe = torch.tensor([scale])
    assert first.judge(probe, None).reason == second.judge(probe, None).reason


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3), min_size=2, max_size=16), st.floats(0.01, 1e3))
def test_the_cosine_check_is_scale_free(values: list[float], scale: float) -> None:
    """Scaling an update does not move it past the cosine bound: only its direction counts."""
    g = torch.tensor(values, dtype=torch.float64)
    momentum = torch.ones(len(values), dtype=torch.float64)
    judge = RobustFilter(RobustConfig()).judge
    assert judge(g, momentum).reason == judge(g * scale, momentum).reason


@pytest.mark.parametrize(
    "bad", [{"window": 0}, {"warmup": 0}, {"max_norm_to_median": -1.0}, {"min_cosine": -2.0}]
)
def test_bad_robust_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RobustConfig(**bad)  # type: ignore[arg-type]


ENTRY = st.floats(-1e3, 1e3).filter(lambda x: x == 0 or abs(x) >= 1e-100)
"""An update's or momentum's entry: products of two stay normal floats (a subnormal dot, of
entries near 1e-309, keeps too few digits for two summation orders to agree to 1e-9)."""


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(ENTRY, ENTRY, ENTRY), min_size=1, max_size=16),
    st.floats(-1.0, 0.5),
)  # fmt: skip
def test_judging_against_the_momentum_parts_is_judging_against_their_sum(
    columns: list[tuple[float, float, float]], min_cosine: float
) -> None:
    """The merge path passes the momentum as parts (never summed): the verdict is the same."""
    g, buf, acc = torch.tensor(columns, dtype=torch.float64).unbind(1)
    judge = RobustFilter(RobustConfig(min_cosine=min_cosine)).judge
    by_parts, by_sum = judge(g, [buf, acc]), judge(g, buf + acc)
    assert by_parts.reason == by_sum.reason
    if by_parts.cosine is not None and by_sum.cosine is not None:
        assert by_parts.cosine == pytest.approx(by_sum.cosine, rel=1e-9, abs=1e-9)
    elif by_parts.cosine is None and by_sum.cosine is not None:  # left out: along the momentum
        assert by_sum.cosine >= -1e-9 and min_cosine < 0


def test_an_update_against_the_momentum_is_zeroed_mid_round() -> None:
    """Delayed Nesterov mid-round: the direction is the momentum plus the unfolded shares."""
    config = MergeConfig(
        outer=OuterConfig(kind="delayed_nesterov", lr=0.1, momentum=0.9),
        token_weight=CONFIG.token_weight,
        max_inner_steps=100,
        max_tokens_per_step=100,
    )
    replica = Replica(torch.full((NUMEL,), 10.0), make_outer_optimizer(config.outer, NUMEL))
    pipeline = UpdatePipeline(replica, config, FINGERPRINT)
    pipeline.clock = lambda: 1000.0
    for seq in range(3):  # 3 of a round of 4: the momentum lives in the unfolded shares
        assert pipeline.submit(update(HONEST, seq, honest_delta(seq), learners=4)).robust is None
    assert len(replica.outer.momentum_parts()) == 2

    result = pipeline.submit(update(MALLORY, 0, -honest_delta(9), learners=4))

    assert result.accepted and result.robust == "against_momentum" and result.weight == 0.0


@settings(max_examples=40, deadline=None)
@given(
    before=st.integers(4, 40),
    step=st.floats(4.5, 1000.0),
    jitter=st.lists(st.floats(0.9, 1.1), min_size=100, max_size=100),
)
def test_honest_norms_that_step_up_are_passed_again(
    before: int, step: float, jitter: list[float]
) -> None:
    """Norms that grow for good (the inner lr's warm-up, error feedback's residual, a fragment
    whose first update covered a partial round) are clipped for a while, then pass again:
    the bound follows them instead of freezing at the old median."""
    robust = RobustFilter(RobustConfig())
    for _ in range(before):
        robust.record(robust.judge(torch.tensor([1.0]), None))
    verdicts = []
    for factor in jitter:
        verdict = robust.judge(torch.tensor([step * factor]), None)
        robust.record(verdict)
        verdicts.append(verdict.reason)
    assert verdicts[0] == "norm_outlier"
    assert verdicts[-20:] == [None] * 20


@settings(max_examples=60, deadline=None)
@given(
    norms=st.lists(st.floats(0.5, 2.0), min_size=4, max_size=32),
    outlier=st.floats(8.1, 1e6),
)
def test_a_clipped_update_moves_the_median_as_one_at_the_bound(
    norms: list[float], outlier: float
) -> None:
    clipped, at_bound = RobustFilter(RobustConfig()), RobustFilter(RobustConfig())
    for norm in norms:
        for robust in (clipped, at_bound):
            robust.record(robust.judge(torch.tensor([norm]), None))
    median = clipped.median_norm()
    assert median is not None
    verdict = clipped.judge(torch.tensor([outlier * median]), None)
    clipped.record(verdict)
    at_bound.record(at_bound.judge(torch.tensor([4.0 * median]), None))

    assert verdict.reason == "norm_outlier"
    assert clipped.median_norm() == pytest.approx(at_bound.median_norm(), rel=1e-6)


def test_an_update_against_the_momentum_leaves_the_median_alone() -> None:
    robust = RobustFilter(RobustConfig())
    for _ in range(8):
        robust.record(robust.judge(torch.tensor([1.0, 0.0]), None))
    verdict = robust.judge(torch.tensor([-0.1, 0.0]), torch.tensor([1.0, 0.0]))
    robust.record(verdict)
    assert verdict.reason == "against_momentum"
    assert robust.median_norm() == 1.0
