import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from merge.weighting import (
    StalenessConfig,
    TokenWeightConfig,
    rounds_stale,
    rounds_weight,
    staleness_weight,
    token_weight,
)


@pytest.mark.parametrize(
    ("config", "staleness", "expected"),
    [
        (StalenessConfig(kind="constant"), 0, 1.0),
        (StalenessConfig(kind="constant"), 100, 1.0),
        (StalenessConfig(), 0, 1.0),
        (StalenessConfig(), 3, 0.5),  # (1+3)^-0.5
        (StalenessConfig(), 8, 1 / 3),  # (1+8)^-0.5
        (StalenessConfig(kind="polynomial", a=1.0), 1, 0.5),
        (StalenessConfig(kind="hinge", a=0.5, b=4), 0, 1.0),
        (StalenessConfig(kind="hinge", a=0.5, b=4), 4, 1.0),
        (StalenessConfig(kind="hinge", a=0.5, b=4), 6, 0.5),  # 1/(0.5*2+1)
        (StalenessConfig(kind="hinge", a=0.5, b=4), 10, 0.25),  # 1/(0.5*6+1)
        (StalenessConfig(kind="exponential", a=0.5), 0, 1.0),
        (StalenessConfig(kind="exponential", a=0.5), 2, math.exp(-1)),
        (StalenessConfig(kind="exponential", a=math.log(2)), 3, 0.125),
    ],
)
def test_staleness_weight_matches_hand_computed_values(
    config: StalenessConfig, staleness: int, expected: float
) -> None:
    assert staleness_weight(config, staleness) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("staleness", "learners", "rounds"),
    [(0, 1, 0.0), (3, 1, 3.0), (0, 4, 0.0), (3, 4, 0.0), (5, 4, 0.5), (7, 4, 1.0), (2, 3, 0.0)],
)
def test_staleness_counts_rounds_beyond_the_updates_own(
    staleness: int, learners: int, rounds: float
) -> None:
    assert rounds_stale(staleness, learners) == rounds
    expected = (1 + rounds) ** -0.5
    assert staleness_weight(StalenessConfig(), staleness, learners) == pytest.approx(expected)


@given(staleness=st.integers(0, 10_000), learners=st.integers(1, 256))
def test_staleness_weight_never_grows_with_staleness(staleness: int, learners: int) -> None:
    for config in (
        StalenessConfig(),
        StalenessConfig(kind="hinge"),
        StalenessConfig(kind="exponential"),
    ):
        now = staleness_weight(config, staleness, learners)
        assert 0 < now <= 1 or (config.kind == "exponential" and now == 0)
        assert staleness_weight(config, staleness + 1, learners) <= now


def test_learners_must_be_a_positive_integer() -> None:
    with pytest.raises(ValueError):
        rounds_stale(1, 0)


def test_negative_staleness_is_refused() -> None:
    with pytest.raises(ValueError):
        staleness_weight(StalenessConfig(), -1)


@pytest.mark.parametrize(
    "kwargs",
    [{"kind": "linear"}, {"a": -0.1}, {"b": -1.0}, {"a": float("nan")}, {"b": float("inf")}],
)
def test_invalid_staleness_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        StalenessConfig(**kwargs)  # type: ignore[arg-type]


def test_token_weight_is_proportional_to_tokens() -> None:
    config = TokenWeightConfig(reference_tokens=1000)

    assert token_weight(config, 500) == 0.5
    assert token_weight(config, 1000) == 1.0
    assert token_weight(config, 2500) == 2.5


def test_token_weight_none_weighs_every_update_one() -> None:
    assert token_weight(TokenWeightConfig(kind="none", reference_tokens=1000), 17) == 1.0


@pytest.mark.parametrize("kwargs", [{"reference_tokens": 0}, {"reference_tokens": 1, "kind": "x"}])
def test_invalid_token_weight_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TokenWeightConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("staleness", "learners", "late", "expected"),
    [
        (2, 3, 0, 0.0),  # the two others of its round: fresh
        (2, 3, 2, 2 / 3),  # the two were the round before's, missing from its base
        (4, 3, 2, 2 / 3),  # two late, two of its own round
        (6, 3, 2, 4 / 3),  # two late, four of its own: two beyond the M - 1
        (5, 1, 5, 5.0),  # one learner: every update counts anyway
    ],
)
def test_late_updates_count_in_full(
    staleness: int, learners: int, late: int, expected: float
) -> None:
    assert rounds_stale(staleness, learners, late) == pytest.approx(expected)


@given(st.integers(0, 10_000), st.integers(1, 1024), st.data())
def test_late_never_lowers_the_rounds_and_zero_late_is_the_signed_count(
    staleness: int, learners: int, data: st.DataObject
) -> None:
    late = data.draw(st.integers(0, staleness))
    plain = rounds_stale(staleness, learners)
    assert rounds_stale(staleness, learners, 0) == plain
    assert plain <= rounds_stale(staleness, learners, late) <= staleness / learners
    config = StalenessConfig()
    assert staleness_weight(config, staleness, learners, late) <= staleness_weight(
        config, staleness, learners
    )


@pytest.mark.parametrize("late", [-1, 4, 1.5])
def test_late_must_be_a_count_within_the_staleness(late: object) -> None:
    with pytest.raises(ValueError, match="late"):
        rounds_stale(3, 2, late)  # type: ignore[arg-type]


@given(
    staleness=st.integers(0, 200),
    learners=st.integers(1, 64),
    kind=st.sampled_from(["constant", "polynomial", "hinge", "exponential"]),
)
def test_staleness_weight_is_the_weight_of_its_rounds(
    staleness: int, learners: int, kind: str
) -> None:
    config = StalenessConfig(kind=kind)  # type: ignore[arg-type]
    rounds = rounds_stale(staleness, learners)
    assert staleness_weight(config, staleness, learners) == rounds_weight(config, rounds)


@pytest.mark.parametrize("rounds", [-0.5, math.inf, math.nan])
def test_rounds_weight_refuses_negative_or_non_finite_rounds(rounds: float) -> None:
    with pytest.raises(ValueError):
        rounds_weight(StalenessConfig(), rounds)
