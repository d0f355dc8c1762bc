"""node.save_cadence: a round in progress is saved as often as its measured cost allows."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.save_cadence import SaveCadence

costs = st.floats(min_value=0.0, max_value=100.0, allow_nan=False, allow_subnormal=False)


def test_a_cheap_save_comes_every_min_s_and_a_costly_one_at_most_every_max_s() -> None:
    cadence = SaveCadence(min_s=1.0, max_s=5.0)
    assert cadence.period_s == 1.0  # nothing measured yet
    cadence.observe_copy(0.002)
    cadence.observe_write(0.03)
    assert cadence.period_s == 1.0
    assert not cadence.due(0.9) and cadence.due(1.0)
    cadence.observe_write(0.17)  # smoothed: (0.03 + 0.17) / 2 = 0.1 s, 5 % of 2 s
    assert cadence.period_s == pytest.approx(2.0)
    cadence.observe_copy(10.0)
    assert cadence.period_s == 5.0


@given(copies=st.lists(costs, max_size=8), writes=st.lists(costs, max_size=8))
def test_the_period_keeps_each_cost_under_its_share_within_the_bounds(
    copies: list[float], writes: list[float]
) -> None:
    cadence = SaveCadence(min_s=1.0, max_s=5.0, copy_share=0.01, write_share=0.05)
    for seconds in copies:
        cadence.observe_copy(seconds)
    for seconds in writes:
        cadence.observe_write(seconds)
    period = cadence.period_s
    assert 1.0 <= period <= 5.0
    if period < 5.0:  # below the bound, each measured cost is within its share of a period
        assert (cadence.copy_s or 0.0) <= 0.01 * period + 1e-12
        assert (cadence.write_s or 0.0) <= 0.05 * period + 1e-12
    if copies:
        assert min(copies) <= (cadence.copy_s or 0.0) <= max(copies)


@given(seconds=st.sampled_from([float("nan"), float("inf"), -1.0]))
def test_a_measurement_that_is_not_a_duration_changes_nothing(seconds: float) -> None:
    cadence = SaveCadence(min_s=1.0, max_s=5.0)
    cadence.observe_write(0.1)
    cadence.observe_write(seconds)
    assert cadence.write_s == 0.1


@pytest.mark.parametrize("bounds", [(0.0, 5.0), (6.0, 5.0), (1.0, float("inf"))])
def test_bounds_out_of_order_are_one_clear_error(bounds: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="0 < min <= max"):
        SaveCadence(min_s=bounds[0], max_s=bounds[1])
