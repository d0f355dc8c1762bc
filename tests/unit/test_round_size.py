"""Dynamic local updates: round lengths follow measured throughput, robust to lying peers."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.round_size import PeerRate, RoundSizeConfig, RoundSizer

H = 32


def sizer(own_rate: float | None = None, **kwargs: object) -> RoundSizer:
    s = RoundSizer(RoundSizeConfig(max_steps=H, **kwargs))  # type: ignore[arg-type]
    if own_rate is not None:
        s.observe_round(H, H / own_rate)
    return s


def deliver(s: RoundSizer, peer: str, steps: int, every_s: float, count: int = 4) -> None:
    """``count`` updates of ``steps`` inner steps from ``peer``, one every ``every_s`` seconds."""
    for i in range(count):
        s.observe_update(peer, steps, 100.0 + i * every_s)


def test_a_learner_runs_h_until_it_has_measured_itself() -> None:
    s = sizer()
    deliver(s, "fast", H, 1.0)

    assert s.steps([PeerRate("fast", 1000.0)]) == H


def test_alone_or_fastest_a_learner_runs_h() -> None:
    s = sizer(own_rate=10.0)
    deliver(s, "slow", H // 4, H / 10.0)

    assert s.steps([]) == H
    assert s.steps([PeerRate("slow", 2.5)]) == H


def test_slower_learners_run_proportionally_fewer_steps() -> None:
    # 1 : 2 : 4 hardware: the fastest peer runs 8 steps/s and delivers H steps every 4 s.
    for own, expected in ((8.0, H), (4.0, H // 2), (2.0, H // 4)):
        s = sizer(own_rate=own)
        deliver(s, "fastest", H, H / 8.0)
        assert s.steps([PeerRate("fastest", 8.0)]) == expected


def test_the_slowest_learner_keeps_a_floor_of_h_over_16() -> None:
    s = sizer(own_rate=0.1)
    deliver(s, "fast", H, H / 100.0)

    assert s.steps([PeerRate("fast", 100.0)]) == H // 16


def test_the_floor_is_one_step_for_a_small_h() -> None:
    s = RoundSizer(RoundSizeConfig(max_steps=3))
    s.observe_round(3, 300.0)
    for i in range(3):
        s.observe_update("fast", 3, float(i))

    assert s.steps([PeerRate("fast", 100.0)]) == 1


def test_an_absurd_claim_not_borne_out_by_updates_moves_nothing() -> None:
    s = sizer(own_rate=10.0)
    deliver(s, "liar", H, H / 10.0)  # its updates arrive at an honest 10 steps/s

    # slack 4: credited up to 40 steps/s, not 1e12; a quarter of H, not one step.
    assert s.steps([PeerRate("liar", 1e12)]) == H // 4
    assert s.steps([PeerRate("liar", math.inf)]) == H
    assert s.steps([PeerRate("liar", math.nan)]) == H


def test_a_peer_counts_only_once_two_of_its_updates_were_merged() -> None:
    s = sizer(own_rate=4.0)
    claims = [PeerRate("new", 8.0)]
    assert s.steps(claims) == H
    s.observe_update("new", H, 0.0)
    assert s.steps(claims) == H
    s.observe_update("new", H, H / 8.0)
    assert s.steps(claims) == H // 2


def test_a_forgotten_peer_no_longer_counts() -> None:
    s = sizer(own_rate=4.0)
    deliver(s, "gone", H, H / 8.0)
    s.forget("gone")

    assert s.steps([PeerRate("gone", 8.0)]) == H


def test_the_own_rate_is_a_moving_average_of_rounds() -> None:
    s = RoundSizer(RoundSizeConfig(max_steps=H, smoothing=0.5))
    s.observe_round(10, 1.0)
    s.observe_round(10, 0.5)
    s.observe_round(0, 1.0)  # an empty round says nothing
    s.observe_round(5, 0.0)  # nor one of no time

    assert s.own_rate == pytest.approx(15.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_steps": 0}, {"min_fraction": 0.0}, {"min_fraction": 1.5}, {"smoothing": 0.0},
     {"slack": 0.5}, {"slack": math.inf}, {"window": 1}],
)  # fmt: skip
def test_invalid_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RoundSizeConfig(**{"max_steps": H, **kwargs})  # type: ignore[arg-type]


rates = st.floats(min_value=1e-3, max_value=1e3)
claims = st.one_of(rates, st.sampled_from([0.0, math.inf, math.nan, 1e300, -1.0]))


@settings(max_examples=50, deadline=None)
@given(
    own=rates,
    peers=st.lists(st.tuples(claims, rates), max_size=6),
)
def test_steps_stay_within_the_floor_and_h_and_follow_the_own_rate(
    own: float, peers: list[tuple[float, float]]
) -> None:
    s = sizer(own_rate=own)
    rated = []
    for i, (claim, delivered) in enumerate(peers):
        deliver(s, f"p{i}", H, H / delivered)
        rated.append(PeerRate(f"p{i}", claim))
    steps = s.steps(rated)

    assert RoundSizeConfig(max_steps=H).min_steps <= steps <= H
    # Deterministic: the same observations give the same answer.
    assert s.steps(rated) == steps
    # Whatever the peers claim, a learner at least as fast as all of them runs H.
    faster = sizer(own_rate=max([own, *(d for _, d in peers)]) * 4.0 + 1.0)
    for i, (_, delivered) in enumerate(peers):
        deliver(faster, f"p{i}", H, H / delivered)
    assert faster.steps([PeerRate(p.peer_id, min(p.steps_per_s, 1.0)) for p in rated]) == H


@settings(max_examples=50, deadline=None)
@given(own=rates, honest=st.lists(rates, min_size=1, max_size=5), lie=claims)
def test_a_lying_peer_shrinks_a_round_no_more_than_its_updates_allow(
    own: float, honest: list[float], lie: float
) -> None:
    """A liar whose updates arrive like the slowest honest peer's changes nothing beyond
    what a peer that fast (times the slack) would."""
    s = sizer(own_rate=own)
    rated = []
    for i, rate in enumerate(honest):
        deliver(s, f"h{i}", H, H / rate)
        rated.append(PeerRate(f"h{i}", rate))
    honest_steps = s.steps(rated)
    slowest = min(honest)
    deliver(s, "liar", H, H / slowest)
    with_liar = s.steps([*rated, PeerRate("liar", lie)])

    bound = sizer(own_rate=own)
    deliver(bound, "bound", H, H / slowest)
    worst = bound.steps([PeerRate("bound", 4.0 * slowest)])
    assert with_liar >= min(honest_steps, worst)
