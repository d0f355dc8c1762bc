"""The goodput simulator: exact without failures, monotone in the failure rate, calibrated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.goodput_config import AsyncCosts, SimConfig, async_costs, restart_recovery_s
from bench.goodput_sim import simulate

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


def test_the_async_rows_take_the_measured_restart_and_say_so(tmp_path: Path) -> None:
    figures = {"start_to_first_step_s": 6.0, "partial_save_s": 5.0, "import_torch_s": 4.0}
    path = tmp_path / "restart.txt"
    path.write_text("phase lines first\n" + json.dumps(figures) + "\n")
    measured = SimConfig(horizon_h=2.0, restart_figures=str(path))
    costs = async_costs(measured)
    assert costs.recovery_s == 6.0 + 5.0 / 2  # start-up plus the steps a kill -9 loses
    assert "bench.restart" in costs.source and str(path) in costs.source
    assert async_costs(SimConfig()) == AsyncCosts(17.5, "the paper's calibration (reconfig_s)")
    assert async_costs(SimConfig(async_recovery_s=3.0)).recovery_s == 3.0

    paper = SimConfig(horizon_h=2.0)
    assert simulate(measured, "async", 1_200_000, 8) > simulate(paper, "async", 1_200_000, 8)
    for method in ("dp", "dp_elastic"):  # the data-parallel rows stay on the calibration
        assert simulate(measured, method, 1_200_000, 1) == simulate(paper, method, 1_200_000, 1)


@pytest.mark.parametrize(
    "figures",
    [{}, {"start_to_first_step_s": 6.0}, {"start_to_first_step_s": "x", "partial_save_s": 5},
     {"start_to_first_step_s": -1.0, "partial_save_s": 5.0},
     {"start_to_first_step_s": float("nan"), "partial_save_s": 5.0}],
)  # fmt: skip
def test_figures_that_are_not_bench_restarts_are_refused(figures: dict) -> None:
    with pytest.raises(ValueError, match="bench.restart"):
        restart_recovery_s(figures)


def test_a_file_without_bench_restarts_line_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.json"
    path.write_text("no figures here\n")
    with pytest.raises(ValueError, match="no JSON line"):
        async_costs(SimConfig(restart_figures=str(path)))
