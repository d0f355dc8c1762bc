"""Goodput under chip failures at a scale this machine cannot run: a discrete-event simulator.

    python -m bench.goodput_sim               # the table: 150k..2.4M chips, M = 1, 2, 8, 16
    python -m bench.goodput_sim --chips 1200000 --learners 8 --horizon-h 6
    python -m bench.goodput_sim --no-plot     # no bench/results/goodput_vs_failure_rate.png

Goodput is the share of allocated chip-time spent on compute that ends up in the model
(Decoupled DiLoCo, arXiv 2604.21428). Every chip fails as a Poisson process with the per-chip
mean time between interruptions (MTBI); a learner of n chips therefore fails as one Poisson
process of rate n / MTBI (superposition), which is what is simulated: events per learner, not
per chip. Each learner is a synchronous group whose steps wait for its slowest chip. Methods:

- dp: one learner, not elastic: a failure loses the step in flight and restarts the whole job
  (restart_s) on spare hosts.
- dp_elastic: one learner that drops the failed host and reconfigures (reconfig_s); repaired
  hosts rejoin at the next reconfiguration.
- sync_diloco: M elastic learners that barrier at every outer step (every H inner steps); a
  learner that fails mid-round loses its round and rejoins at the first round start after it
  has reconfigured, while the others wait at the barrier for the slowest live learner.
- async: M elastic learners that never wait for each other (this project, Decoupled DiLoCo); a
  failure costs its learner the step in flight and a reconfiguration, and the round goes on.

Interruptions strike running chips only (the clock of a learner stops while it restarts or
waits at a barrier), so the non-elastic and elastic data-parallel rows follow
1 / (1 + rate * cost): the calibration targets below fix restart_s and reconfig_s. The
asynchronous rows take their recovery per failure from this project's own measurement when
there is one (issue 23): `--restart-figures FILE` (default bench/results/restart.json, the
committed figures; `python -m bench.restart --out FILE` writes new ones) gives
bench.restart's start_to_first_step_s plus half its partial_save_s (the inner steps a kill -9
loses on average); `--async-recovery-s` sets it by hand; with neither they use reconfig_s,
the paper's calibration. The output says which. The final line is JSON:
{"rows": [{"method", "chips", "learners", "goodput", ...}, ...],
"async_costs": {"recovery_s", "source"}}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
from collections import deque
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pydantic.dataclasses
from scipy.special import ndtri

from node.config import add_config_arguments, config_from_args
from node.settings import FLAGS

logger = logging.getLogger(__name__)

YEAR_S = 365.25 * 24 * 3600
METHODS = ("dp", "dp_elastic", "sync_diloco", "async")
CHIP_COUNTS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
LEARNER_COUNTS = (1, 2, 8, 16)
PAPER = {
    ("dp_elastic", 1_200_000, 1): 0.58,
    ("async", 1_200_000, 2): 0.70,
    ("async", 1_200_000, 8): 0.88,
    ("async", 1_200_000, 16): 0.93,
    ("dp", 2_400_000, 1): 0.18,
    ("dp_elastic", 2_400_000, 1): 0.40,
    ("async", 2_400_000, 8): 0.80,
    ("async", 2_400_000, 16): 0.86,
}
"""Decoupled DiLoCo's reported goodput at MTBI 1 year, by (method, chips, learners)."""
RESULTS_DIR = Path(__file__).resolve().parent / "results"
RESTART_FIGURES = RESULTS_DIR / "restart.json"
"""The committed bench.restart line the docs cite (`python -m bench.restart --out` writes one)."""


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


@dataclass(frozen=True)
class Steps:
    """Steps a learner completed: end times and the chip-seconds of compute behind each."""

    ends: np.ndarray
    chip_s: np.ndarray


class LearnerSim:
    """One learner of `chips` chips: runs steps, fails as a Poisson process, recovers."""

    def __init__(
        self,
        config: SimConfig,
        chips: int,
        rng: np.random.Generator,
        *,
        elastic: bool,
        recovery_s: float | None = None,
    ) -> None:
        """`recovery_s`: an elastic learner's recovery per failure (default: reconfig_s)."""
        self.config = config
        self.chips = chips
        self.rng = rng
        self.elastic = elastic
        self.recovery_s = config.reconfig_s if recovery_s is None else recovery_s
        self.t = 0.0
        self.num_failures = 0
        self._to_failure: float | None = None
        self._repairs: deque[float] = deque()
        self._active = chips

    def run_steps(self, num_steps: int, *, stop_on_failure: bool = False) -> tuple[Steps, bool]:
        """Run `num_steps` steps through any failures; (steps done, whether one failed)."""
        ends: list[np.ndarray] = []
        credits: list[np.ndarray] = []
        failed = False
        while num_steps > 0:
            if self._to_failure is None:
                self._to_failure = self.rng.exponential(self.config.mtbi_s / self._active)
            batch = min(num_steps, int(self._to_failure / self.config.step_s * 1.1) + 8)
            elapsed = np.cumsum(self._step_times(batch))
            done = min(batch, int(np.searchsorted(elapsed, self._to_failure, side="right")))
            ends.append(self.t + elapsed[:done])
            credits.append(np.full(done, self._active * self.config.step_s))
            num_steps -= done
            if done == batch:  # no failure within this batch of steps
                self._to_failure -= float(elapsed[-1])
                self.t += float(elapsed[-1])
                continue
            self.t += self._to_failure
            self._fail()
            failed = True
            if stop_on_failure:
                break
        empty = [np.empty(0)]
        return Steps(np.concatenate(ends or empty), np.concatenate(credits or empty)), failed

    def _step_times(self, num_steps: int) -> np.ndarray:
        """Each step waits for the slowest of the active chips."""
        c = self.config
        if c.speed_cv == 0:
            return np.full(num_steps, c.step_s)
        return c.step_s * np.maximum(0.0, 1.0 + c.speed_cv * self._slowest_z(num_steps))

    def _slowest_z(self, size: int) -> np.ndarray:
        """Exact draws of the maximum of `active` standard normals: Phi^-1(U^(1/n))."""
        tail = -np.expm1(np.log(self.rng.random(size)) / self._active)
        return np.asarray(-ndtri(tail))

    def _fail(self) -> None:
        """The step in flight is lost; the learner restarts or drops the host and re-forms."""
        c = self.config
        self.num_failures += 1
        self._to_failure = None
        if not self.elastic:
            self.t += c.restart_s
            return
        self._repairs.append(self.t + c.repair_s)
        while self._repairs and self._repairs[0] <= self.t:  # repaired hosts rejoin now
            self._repairs.popleft()
        self._active = max(1, self.chips - len(self._repairs) * c.host_chips)
        self.t += self.recovery_s


def simulate(config: SimConfig, method: str, chips: int, learners: int) -> float:
    """Goodput of one setting: useful chip-seconds over allocated chip-seconds."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if chips < learners or learners < 1:
        raise ValueError(f"need at least one chip per learner, got {chips} chips, {learners}")
    rng = np.random.default_rng([config.seed, chips, learners, METHODS.index(method)])
    if method in ("dp", "dp_elastic"):
        useful = _data_parallel(config, chips, rng, elastic=method == "dp_elastic")
    elif method == "async":
        useful = _asynchronous(config, chips, learners, rng)
    else:
        useful = _synchronous_diloco(config, chips, learners, rng)
    return useful / (chips * config.horizon_s)


def _learner_sizes(chips: int, learners: int) -> list[int]:
    base, extra = divmod(chips, learners)
    return [base + (i < extra) for i in range(learners)]


def _data_parallel(config: SimConfig, chips: int, rng: np.random.Generator, elastic: bool) -> float:
    """One learner of every chip; a step's compute counts once the step completes."""
    learner = LearnerSim(config, chips, rng, elastic=elastic)
    chunk = max(1, math.ceil(3600 / config.step_s))
    useful = 0.0
    while learner.t < config.horizon_s:
        steps, _ = learner.run_steps(chunk)
        useful += float(steps.chip_s[steps.ends <= config.horizon_s].sum())
    return useful


def _asynchronous(config: SimConfig, chips: int, learners: int, rng: np.random.Generator) -> float:
    """Independent learners; a round's compute counts once the round is published."""
    useful = 0.0
    recovery_s = async_costs(config).recovery_s
    for size in _learner_sizes(chips, learners):
        learner = LearnerSim(config, size, rng, elastic=True, recovery_s=recovery_s)
        while learner.t < config.horizon_s:
            steps, _ = learner.run_steps(config.inner_steps)
            if learner.t <= config.horizon_s:
                useful += float(steps.chip_s.sum())
    return useful


def _synchronous_diloco(
    config: SimConfig, chips: int, learners: int, rng: np.random.Generator
) -> float:
    """Rounds in lockstep: a learner that fails mid-round loses it, the rest wait at the barrier."""
    sims = [LearnerSim(config, size, rng, elastic=True) for size in _learner_sizes(chips, learners)]
    useful, round_start = 0.0, 0.0
    while round_start < config.horizon_s:
        done, credit = [], 0.0
        for sim in (s for s in sims if s.t <= round_start):
            sim.t = round_start  # idle at the barrier until the round starts
            steps, failed = sim.run_steps(config.inner_steps, stop_on_failure=True)
            if not failed:
                done.append(sim.t)
                credit += float(steps.chip_s.sum())
        if done:
            round_start = max(done) + config.outer_sync_s
            useful += credit if round_start <= config.horizon_s else 0.0
        else:
            round_start = min(s.t for s in sims)
    return useful


# ---- the table and the plot ---------------------------------------------------------------------


def table_rows(config: SimConfig, chip_counts: list[int], learner_counts: list[int]) -> list[dict]:
    rows = []
    for chips in chip_counts:
        for method in METHODS:
            counts = [1] if method.startswith("dp") else learner_counts
            for learners in counts:
                goodput = simulate(config, method, chips, learners)
                row = {"method": method, "chips": chips, "learners": learners}
                row |= {"goodput": round(goodput, 4), "mtbi_years": config.mtbi_years}
                if (paper := PAPER.get((method, chips, learners))) is not None:
                    row["paper"] = paper
                rows.append(row)
                logger.info("%s", row)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'chips':>10}  {'method':<12}{'M':>3}  {'goodput':>8}  {'paper':>6}"]
    for r in rows:
        paper = f"{r['paper']:.2f}" if "paper" in r else "-"
        setting = f"{r['chips']:>10,}  {r['method']:<12}{r['learners']:>3}"
        lines.append(f"{setting}  {r['goodput']:>8.3f}  {paper:>6}")
    return "\n".join(lines)


PLOT_SERIES = (("dp", 1), ("dp_elastic", 1), ("sync_diloco", 8), ("async", 8), ("async", 16))
PLOT_RATES = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
"""Interruptions per chip-year plotted (the paper's setting is 1)."""


def failure_rate_curves(config: SimConfig, chips: int) -> dict[str, list[float]]:
    curves = {}
    for method, learners in PLOT_SERIES:
        label = method if method.startswith("dp") else f"{method} M={learners}"
        curves[label] = [
            simulate(replace(config, mtbi_years=1 / rate), method, chips, learners)
            for rate in PLOT_RATES
        ]
    return curves


def plot_curves(curves: dict[str, list[float]], chips: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in curves.items():
        ax.plot(PLOT_RATES, values, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("interruptions per chip-year (1 / MTBI)")
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Goodput vs failure rate, {chips:,} chips (simulated)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser, SimConfig)
    parser.add_argument(
        "--chips",
        type=int,
        nargs="+",
        default=list(CHIP_COUNTS),
        help="chip counts of the table [default: 150k 300k 600k 1.2M 2.4M]",
    )
    parser.add_argument(
        "--learners",
        type=int,
        nargs="+",
        default=list(LEARNER_COUNTS),
        help="learner counts M of sync_diloco and async [default: 1 2 8 16]",
    )
    parser.add_argument(
        "--plot",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write bench/results/goodput_vs_failure_rate.png (matplotlib)",
    )
    parser.add_argument(
        "--plot-chips",
        type=int,
        default=1_200_000,
        help="chips of the plotted cluster [default: 1200000]",
    )
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    config = config_from_args(SimConfig, args)
    if config.restart_figures is None and RESTART_FIGURES.exists():
        config = replace(config, restart_figures=str(RESTART_FIGURES))
    try:
        costs = async_costs(config)  # read once: every async row uses it
    except (OSError, ValueError) as exc:
        parser.error(f"--restart-figures: {exc}")
    config = replace(config, async_recovery_s=costs.recovery_s)
    rows = table_rows(config, args.chips, args.learners)
    print(json.dumps({"config": asdict(config)}))
    print(f"async rows: recovery {costs.recovery_s:.2f} s per failure, {costs.source}")
    print(format_table(rows))
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        print("plot: skipped, matplotlib is not installed (pip install -e '.[bench]')")
    elif args.plot:
        curves = failure_rate_curves(config, args.plot_chips)
        path = plot_curves(curves, args.plot_chips, RESULTS_DIR / "goodput_vs_failure_rate.png")
        print(f"plot: {path}")
    print(json.dumps({"rows": rows, "async_costs": asdict(costs)}))


if __name__ == "__main__":
    main()
