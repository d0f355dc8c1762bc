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
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from bench.goodput_config import SimConfig, async_costs
from bench.goodput_learner import LearnerSim
from node.config import add_config_arguments, config_from_args

logger = logging.getLogger(__name__)

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
