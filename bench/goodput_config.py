"""bench.goodput_sim's cluster: the simulated setting (`SimConfig`, its defaults the paper's)
and what a failure costs an asynchronous learner (`async_costs`: set by hand, measured by
bench.restart, or the paper's calibration). Moved out of bench/goodput_sim.py unchanged in
session 25."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pydantic.dataclasses

from node.settings import FLAGS

YEAR_S = 365.25 * 24 * 3600


@pydantic.dataclasses.dataclass(kw_only=True, config=FLAGS)
class SimConfig:
    """Parameters of the simulated cluster; the defaults reproduce the paper's setting."""

    mtbi_years: float = 1.0
    """Per-chip mean time between interruptions, in years (the paper's setting: 1 year)."""
    step_s: float = 1.0
    """Wall time of one training step of a learner with no straggler, its in-learner all-reduce
    included. 1 s is typical of large-model steps at this scale; a failure loses on average
    half a step, so it matters little next to restart and reconfiguration times."""
    speed_cv: float = 0.005
    """Coefficient of variation of one chip's step time. A step waits for the slowest chip:
    the maximum of n normals (~4.3 sigma at 150k chips, ~5 sigma at 2.4M) costs ~2.5% of every
    step at 0.5%, the straggler loss of a well-tuned fleet."""
    restart_s: float = 56.0
    """Non-elastic recovery: detect, swap in a spare host, restart the job and reload the
    in-memory checkpoint. Calibrated so non-elastic DP lands on the paper's 18% at 2.4M chips."""
    reconfig_s: float = 17.5
    """Elastic recovery: drop the failed host and re-form the learner's mesh. Calibrated so
    elastic DP lands on the paper's 58% at 1.2M chips (it then gives ~41% at 2.4M)."""
    host_chips: int = 4
    """Chips per host, the unit an elastic learner drops when one of them fails."""
    repair_s: float = 3600.0
    """How long a failed host stays out before it may rejoin (elastic methods; it rejoins at its
    learner's next reconfiguration). Its chips stay allocated meanwhile."""
    inner_steps: int = 100
    """H: inner steps per outer round (DiLoCo rounds; a round's work counts once it ends)."""
    outer_sync_s: float = 0.0
    """Blocking time of a synchronous outer all-reduce at each barrier. 0 charges synchronous
    DiLoCo nothing for communication, so its rows isolate the cost of failures and stragglers."""
    horizon_h: float = 24.0
    """Simulated wall time per setting, in hours (a multiple of one round keeps the no-failure
    goodput at exactly 1)."""
    seed: int = 0
    """Seed of the failure and straggler draws; every setting starts from it."""
    async_recovery_s: float | None = None
    """Recovery of an asynchronous learner per failure, in seconds (default: from
    --restart-figures, else reconfig_s, the paper's calibration)."""
    restart_figures: str | None = None
    """A file whose last JSON line is bench.restart's: the asynchronous rows' recovery is
    its start_to_first_step_s plus half its partial_save_s (the command's default:
    bench/results/restart.json when it exists)."""

    def __post_init__(self) -> None:
        for name in ("mtbi_years", "step_s", "horizon_h"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        for name in ("speed_cv", "restart_s", "reconfig_s", "repair_s", "outer_sync_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a non-negative number")
        if self.host_chips < 1 or self.inner_steps < 1:
            raise ValueError("--host-chips and --inner-steps must be positive integers")
        recovery = self.async_recovery_s
        if recovery is not None and not (math.isfinite(recovery) and recovery >= 0):
            raise ValueError("--async-recovery-s must be a non-negative number")

    @property
    def mtbi_s(self) -> float:
        return self.mtbi_years * YEAR_S

    @property
    def horizon_s(self) -> float:
        return self.horizon_h * 3600


@dataclass(frozen=True)
class AsyncCosts:
    """What a failure costs an asynchronous learner, and where the figure comes from."""

    recovery_s: float
    source: str


def restart_recovery_s(figures: dict) -> float:
    """Recovery per failure from bench.restart's figures: process start to the first inner
    step, plus on average half the period of the partial-round saves (the steps a kill -9
    loses). ValueError for figures that are not bench.restart's."""
    try:
        start_s, save_s = float(figures["start_to_first_step_s"]), float(figures["partial_save_s"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"not bench.restart's figures (start_to_first_step_s, partial_save_s): {exc}"
        ) from None
    if not (math.isfinite(start_s) and math.isfinite(save_s) and start_s >= 0 and save_s >= 0):
        raise ValueError("bench.restart's figures must be non-negative numbers")
    return start_s + save_s / 2


def read_restart_figures(path: Path) -> dict:
    """The last JSON line of `path` (bench.restart's output, or only its final line)."""
    lines = [line for line in path.read_text().splitlines() if line.startswith("{")]
    if not lines:
        raise ValueError(f"{path} holds no JSON line of bench.restart")
    figures = json.loads(lines[-1])
    if not isinstance(figures, dict):
        raise ValueError(f"{path}: bench.restart's line is a JSON object")
    return figures


def async_costs(config: SimConfig) -> AsyncCosts:
    """The asynchronous rows' recovery: set by hand, measured, or the paper's calibration."""
    if config.async_recovery_s is not None:
        return AsyncCosts(config.async_recovery_s, "--async-recovery-s")
    if config.restart_figures is not None:
        path = Path(config.restart_figures)
        recovery_s = restart_recovery_s(read_restart_figures(path))
        return AsyncCosts(recovery_s, f"measured: bench.restart ({path})")
    return AsyncCosts(config.reconfig_s, "the paper's calibration (reconfig_s)")
