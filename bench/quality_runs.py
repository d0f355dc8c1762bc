"""bench.quality's runs: one learner, synchronous DiLoCo (bench/sync_baseline.py workers) and
the async swarm (real `diloco-node join` processes), each under a :class:`Schedule` (equal
tokens or equal wall time), evaluated on the same validation batches. Moved out of
bench/quality.py unchanged (session 24).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector

from bench.procs import ChildProcess, cli_flags, python_module, reap_all
from bench.quality_setup import Evaluator, QualityConfig
from node.checkpoint import read_checkpoint

RUN_TIMEOUT_S = 900.0
"""Bound on any one training run."""


def run_single(config: QualityConfig, ev: Evaluator) -> dict:
    steps = config.learners * config.rounds * config.inner_steps
    torch.set_num_threads(config.learners * config.threads)
    learner = ev.learner(steps, "quality/single")
    started = time.perf_counter()
    learner.run_round(steps, lambda: False, lambda _: None)
    params = parameters_to_vector(learner.model.parameters()).detach().float()
    return {
        "method": "single",
        "seed": config.seed,
        "learners": 1,
        "steps": steps,
        "tokens": steps * ev.tokens_per_step,
        "val_loss": ev.val_loss(params),
        "seconds": round(time.perf_counter() - started, 1),
    }


def run_learners(
    config: QualityConfig, home: Path, name: str, argv: Callable[[int], list[str]],
    before_training: Callable[[], None] = lambda: None,
) -> tuple[list[ChildProcess], float]:  # fmt: skip
    """Start `learners` processes (each joins through the first), wait until all have stopped."""
    children: list[ChildProcess] = []
    try:
        started = time.perf_counter()
        for rank in range(len(config.speeds()) or config.learners):
            peers = ["--peers", children[0].of("listening")[0]["maddrs"][0]] if children else []
            child = ChildProcess(
                f"{name}/{rank}", [*argv(rank), *peers], home=home / f"{name}{rank}"
            )
            children.append(child.start())
            child.wait_event("listening", RUN_TIMEOUT_S)
        before_training()
        for child in children:
            child.wait_event("stopped", RUN_TIMEOUT_S)
        return children, time.perf_counter() - started
    finally:
        reap_all(children)


@dataclass(frozen=True)
class Schedule:
    """How long runs last: equal tokens (max_rounds) or equal wall time (budget_s)."""

    decay_steps: int
    """Inner cosine decay horizon, the same for every learner of every run."""
    budget_s: float | None = None
    """Wall-clock seconds of training per run (equal wall time), else None."""
    round_time: float | None = None
    """The async learners' round time (dynamic local updates), else None."""
    emulated_step_s: float | None = None
    """The paced step time of a factor-1 learner (--emulated-step-s), else None."""
    matchmaking_s: float = 2.0
    """How long a sync worker waits for the others at the barrier."""

    def emulation(self, config: QualityConfig, rank: int) -> list[str]:
        """The flags that emulate learner ``rank``'s hardware."""
        speeds = config.speeds()
        flags = cli_flags(speed_factor=speeds[rank] if speeds else 1.0)
        if config.non_iid:
            flags += cli_flags(data_slice=f"{rank}/{len(speeds) or config.learners}")
        if self.emulated_step_s:
            flags += cli_flags(emulated_step_s=self.emulated_step_s)
        return flags


def equal_tokens(config: QualityConfig) -> Schedule:
    return Schedule(decay_steps=config.rounds * config.inner_steps)


def equal_wall_time(config: QualityConfig, step_s: float) -> Schedule:
    """Rounds of the fastest learner's H steps; the sync barrier waits for the slowest."""
    paced = round(step_s * config.pace, 4) if config.pace > 0 else None
    step_s = paced or step_s
    # 5% slack: sleeps overshoot, and a round stops before a step that would overrun it.
    round_time = config.round_time or round(1.05 * config.inner_steps * step_s, 3)
    slowest_round = config.inner_steps * step_s * max(config.speeds())
    return Schedule(
        decay_steps=max(1, int(config.budget_s / step_s)),
        budget_s=config.budget_s,
        round_time=round_time,
        emulated_step_s=paced,
        matchmaking_s=round(2 * slowest_round + 5, 1),
    )


def run_sync(config: QualityConfig, ev: Evaluator, home: Path, schedule: Schedule) -> dict:
    start_file = home / "go"
    limit = cli_flags(max_time=schedule.budget_s) if schedule.budget_s else []
    limit += cli_flags(max_rounds=config.rounds) if not schedule.budget_s else []
    common = cli_flags(
        mode="diloco", num_nodes=len(config.speeds()) or config.learners, model=config.model,
        seed=config.seed, inner_steps=config.inner_steps, threads=config.threads,
        lr_decay_steps=schedule.decay_steps, run_id=f"quality{int(time.time())}",
        start_file=start_file, matchmaking_s=schedule.matchmaking_s,
    ) + limit  # fmt: skip

    def argv(rank: int) -> list[str]:
        own = cli_flags(rank=rank, final_params=home / f"final{rank}.pt")
        own += schedule.emulation(config, rank)
        return python_module("bench.sync_baseline", *common, *own)

    children, seconds = run_learners(config, home, "sync", argv, start_file.touch)
    rounds = [e for c in children for e in c.of("round_done")]
    committed = [e for e in rounds if e["committed"]]
    return {
        "method": "sync_diloco",
        "seed": config.seed,
        "learners": len(children),
        "steps": len(rounds) * config.inner_steps,
        "tokens": len(rounds) * config.inner_steps * ev.tokens_per_step,
        "val_loss": ev.val_loss(torch.load(home / "final0.pt", weights_only=True)),
        "rounds_committed": len(committed) // max(1, len(children)),
        "rounds_lost": len(rounds) - len(committed),
        "wait_s_mean": round(sum(e["wait_s"] for e in rounds) / max(1, len(rounds)), 3),
        "seconds": round(seconds, 1),
    }


def run_async(
    config: QualityConfig, ev: Evaluator, home: Path, schedule: Schedule,
    name: str = "async", correction: str = "none",
) -> dict:  # fmt: skip
    run_id = f"{name.replace('_', '-')}{int(time.time())}"
    limit = cli_flags(max_time=schedule.budget_s) if schedule.budget_s else []
    limit += cli_flags(max_rounds=config.rounds) if not schedule.budget_s else []
    if config.sizing == "dynamic-h" and schedule.budget_s:
        limit += ["--dynamic-h"]
    elif config.sizing == "fixed-h" and schedule.budget_s:
        pass  # every learner runs H steps: slower ones publish rarer, staler updates
    elif schedule.round_time:
        limit += cli_flags(round_time=schedule.round_time)
    common = cli_flags(
        log_format="json", model=config.model, run_id=run_id, inner_steps=config.inner_steps,
        seed=config.seed, threads=config.threads, eval_batches=1, host="127.0.0.1", port=0,
        heartbeat_period=1, linger=_linger_s(schedule), lr_decay_steps=schedule.decay_steps,
        correction=correction,
    ) + ["--linger-until-done"] + limit  # fmt: skip
    if correction != "none":
        common += cli_flags(correction_strength=config.strength())

    def argv(rank: int) -> list[str]:
        return python_module("node", "join", *common, *schedule.emulation(config, rank))

    # --linger: a learner that finishes first keeps serving its last update to the others.
    children, seconds = run_learners(config, home, name, argv)
    replicas = [_replica(home / f"{name}{n}", run_id) for n in range(len(children))]
    per_node = [ev.val_loss(p) for _, p in replicas]
    num_applied = max(n for n, _ in replicas)
    # Replicas holding the same updates differ by the order they applied them in (the outer
    # momentum folds at a different update on each): the figure is their mean.
    full = [loss for (n, _), loss in zip(replicas, per_node, strict=True) if n == num_applied]
    rounds = [e for c in children for e in c.of("round_done")]
    merged = [e for c in children[:1] for e in c.of("update_merged")]
    return {
        "method": name,
        "seed": config.seed,
        "learners": len(children),
        "correction": correction,
        "steps": sum(e["tokens"] for e in rounds) // ev.tokens_per_step,
        "tokens": sum(e["tokens"] for e in rounds),
        "val_loss": round(sum(full) / len(full), 5),
        "val_loss_per_node": per_node,
        "num_applied": num_applied,
        "num_applied_per_node": [n for n, _ in replicas],
        "updates_published": sum(e["seq"] is not None for e in rounds),
        "rounds_per_node": [len(c.of("round_done")) for c in children],
        "steps_per_round_per_node": [_mean_steps(c, ev) for c in children],
        "staleness_mean": round(sum(e["staleness"] for e in merged) / max(1, len(merged)), 2),
        "blocks_corrected": sum(e.get("blocks_corrected", 0) for e in merged),
        "seconds": round(seconds, 1),
    }


def _linger_s(schedule: Schedule) -> float:
    """Long enough for the last learner's last round to reach those that finished first
    (a learner stops lingering once every peer has finished and its last update is merged)."""
    return max(120.0, round(4 * (schedule.round_time or 0) + 30, 1))


def _mean_steps(child: ChildProcess, ev: Evaluator) -> float:
    rounds = child.of("round_done")
    return round(sum(e["tokens"] for e in rounds) / ev.tokens_per_step / max(1, len(rounds)), 1)


def calibrate_step_s(config: QualityConfig, ev: Evaluator, steps: int = 10) -> float:
    """Mean seconds of one inner step of an undelayed learner (threads as the learners)."""
    torch.set_num_threads(config.threads)
    learner = ev.learner(steps, "quality/calibrate")
    learner.run_round(3, lambda: False, lambda _: None)  # warm up
    stats = learner.run_round(steps, lambda: False, lambda _: None)
    return stats.compute_s / stats.num_steps


def _replica(home: Path, run_id: str) -> tuple[int, torch.Tensor]:
    state = read_checkpoint(home / ".diloco" / "checkpoints" / run_id)
    if state is None:
        raise RuntimeError(f"learner in {home} left no checkpoint")
    return int(state["replica"]["num_applied"]), state["replica"]["params"]
