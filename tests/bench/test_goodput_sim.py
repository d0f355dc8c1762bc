"""The goodput simulator: exact without failures, monotone in the failure rate, calibrated."""

from __future__ import annotations

import pytest

from bench.goodput_sim import SimConfig, simulate

SETTINGS = [("dp", 1), ("dp_elastic", 1), ("sync_diloco", 8), ("async", 8)]


@pytest.mark.parametrize(("method", "learners"), [*SETTINGS, ("async", 1), ("sync_diloco", 2)])
def test_goodput_is_one_without_failures(method: str, learners: int) -> None:
    config = SimConfig(mtbi_years=1e12, speed_cv=0.0, horizon_h=1.0)
    assert simulate(config, method, 1000, learners) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize(("method", "learners"), SETTINGS)
def test_goodput_falls_monotonically_with_the_failure_rate(method: str, learners: int) -> None:
    rates = [0.25, 1.0, 4.0, 16.0]  # interruptions per chip-year
    goodputs = [
        simulate(SimConfig(mtbi_years=1 / rate, horizon_h=4.0), method, 100_000, learners)
        for rate in rates
    ]
    assert goodputs == sorted(goodputs, reverse=True), goodputs
    assert goodputs[0] > goodputs[-1] + 0.05, goodputs


def test_stragglers_alone_cost_a_few_percent() -> None:
    config = SimConfig(mtbi_years=1e12, horizon_h=1.0)
    assert 0.95 < simulate(config, "async", 1_200_000, 8) < 1.0


def test_the_defaults_land_near_the_papers_figures() -> None:
    config = SimConfig(horizon_h=6.0)
    assert simulate(config, "dp_elastic", 1_200_000, 1) == pytest.approx(0.58, abs=0.1)
    assert simulate(config, "dp", 2_400_000, 1) == pytest.approx(0.18, abs=0.1)
    assert simulate(config, "dp_elastic", 2_400_000, 1) == pytest.approx(0.40, abs=0.1)
    assert simulate(config, "async", 1_200_000, 8) >= 0.88


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="method"):
        simulate(SimConfig(), "allreduce", 100, 1)
    with pytest.raises(ValueError, match="step-s"):
        SimConfig(step_s=0)
