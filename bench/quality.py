"""Quality at equal tokens: one learner, synchronous DiLoCo (M learners), the async swarm (M).

    python -m bench.quality                          # tiny model, M = 4, 10 rounds of H = 20 each
    python -m bench.quality --learners 2 --rounds 20

The same model, corpus (the default stdlib corpus) and inner AdamW, three ways:
- single: one learner, plain AdamW for M x rounds x H steps (the data-parallel reference);
- sync_diloco: M workers of bench/sync_baseline.py, each `rounds` rounds of H steps, pseudo-
  gradients all-reduced with hivemind's DecentralizedAverager, outer Nesterov (0.7, 0.9);
- async: M real `diloco-node join` processes with --max-rounds rounds (this project).
Every final model is evaluated here on the same validation batches. Target (issue 5): the async
final validation loss within 3% of synchronous DiLoCo's. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.nn.utils import parameters_to_vector

from bench.procs import ChildProcess, cli_flags, python_module, reap_all
from node.config import add_dataclass_arguments, dataclass_from_args
from node.data import ShardSampler, load_corpus, split_corpus, validation_batches
from node.learner import InnerConfig, Learner
from node.model import DEFAULT_BATCH_SIZE, DEFAULT_INNER_LR, build_model, model_config

logger = logging.getLogger(__name__)
RUN_TIMEOUT_S = 900.0
"""Bound on any one training run."""


@dataclass(kw_only=True)
class QualityConfig:
    """Equal-token comparison settings."""

    learners: int = 4
    """M: learners of the synchronous and asynchronous runs."""
    rounds: int = 10
    """Rounds of H inner steps per learner (the single learner runs M x rounds x H steps)."""
    inner_steps: int = 20
    """H."""
    model: str = "tiny"
    """Model preset."""
    eval_batches: int = 16
    """Validation batches for the final evaluation of each model."""
    seed: int = 0
    """Genesis seed shared by every run."""
    threads: int = 1
    """torch threads per learner process (the single learner uses learners x threads)."""


class Evaluator:
    """The shared model shape and validation batches; evaluates flat parameter vectors."""

    def __init__(self, config: QualityConfig) -> None:
        self.corpus = load_corpus(None)
        self.split = split_corpus(self.corpus)
        self.model_config = model_config(config.model, self.corpus.vocab_size)
        self.batch_size = DEFAULT_BATCH_SIZE[config.model]
        self.config = config
        self.batches = validation_batches(
            self.split.val,
            batch_size=self.batch_size,
            block_size=self.model_config.block_size,
            num_batches=config.eval_batches,
        )

    def learner(self, steps: int, seed: str) -> Learner:
        model = build_model(self.model_config, self.config.seed)
        sampler = ShardSampler(
            self.split.train,
            seed=seed,
            batch_size=self.batch_size,
            block_size=self.model_config.block_size,
        )
        inner = InnerConfig(
            lr=DEFAULT_INNER_LR[self.config.model],
            weight_decay=0.1,
            grad_clip=1.0,
            warmup_steps=100,
            decay_steps=steps,
        )
        return Learner(model, sampler, inner, torch.device("cpu"))

    def val_loss(self, params: torch.Tensor) -> float:
        learner = self.learner(1, "eval")
        learner.load_params(params)
        return round(learner.evaluate(self.batches), 5)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model_config.block_size


def run_single(config: QualityConfig, ev: Evaluator) -> dict:
    steps = config.learners * config.rounds * config.inner_steps
    torch.set_num_threads(config.learners * config.threads)
    learner = ev.learner(steps, "quality/single")
    started = time.perf_counter()
    learner.run_round(steps, lambda: False, lambda _: None)
    params = parameters_to_vector(learner.model.parameters()).detach().float()
    return {
        "method": "single",
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
        for rank in range(config.learners):
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


def run_sync(config: QualityConfig, ev: Evaluator, home: Path) -> dict:
    start_file = home / "go"
    common = cli_flags(
        mode="diloco", num_nodes=config.learners, model=config.model, seed=config.seed,
        inner_steps=config.inner_steps, max_rounds=config.rounds, threads=config.threads,
        lr_decay_steps=config.rounds * config.inner_steps, run_id=f"quality{int(time.time())}",
        start_file=start_file,
    )  # fmt: skip

    def argv(rank: int) -> list[str]:
        own = cli_flags(rank=rank, final_params=home / f"final{rank}.pt")
        return python_module("bench.sync_baseline", *common, *own)

    children, seconds = run_learners(config, home, "sync", argv, start_file.touch)
    rounds = [e for c in children for e in c.of("round_done")]
    return {
        "method": "sync_diloco",
        "learners": config.learners,
        "steps": len(rounds) * config.inner_steps,
        "tokens": len(rounds) * config.inner_steps * ev.tokens_per_step,
        "val_loss": ev.val_loss(torch.load(home / "final0.pt", weights_only=True)),
        "rounds_lost": sum(not e["committed"] for e in rounds),
        "seconds": round(seconds, 1),
    }


def run_async(config: QualityConfig, ev: Evaluator, home: Path) -> dict:
    run_id = f"quality{int(time.time())}"
    common = cli_flags(
        log_format="json", model=config.model, run_id=run_id, inner_steps=config.inner_steps,
        max_rounds=config.rounds, seed=config.seed, threads=config.threads, eval_batches=1,
        host="127.0.0.1", port=0, heartbeat_period=1, linger=10,
    )  # fmt: skip
    # --linger: a learner that finishes first keeps serving its last update to the others.
    children, seconds = run_learners(
        config, home, "async", lambda _: python_module("node", "join", *common)
    )
    replicas = [_replica(home / f"async{n}", run_id) for n in range(config.learners)]
    num_applied, params = max(replicas, key=lambda r: r[0])
    steps = sum(len(c.of("round_done")) for c in children) * config.inner_steps
    return {
        "method": "async",
        "learners": config.learners,
        "steps": steps,
        "tokens": steps * ev.tokens_per_step,
        "val_loss": ev.val_loss(params),
        "val_loss_per_node": [ev.val_loss(p) for _, p in replicas],
        "num_applied": num_applied,
        "updates_published": config.learners * config.rounds,
        "seconds": round(seconds, 1),
    }


def _replica(home: Path, run_id: str) -> tuple[int, torch.Tensor]:
    path = home / ".diloco" / "checkpoints" / run_id / "checkpoint.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    return int(state["replica"]["num_applied"]), state["replica"]["params"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_dataclass_arguments(parser, QualityConfig)
    config: QualityConfig = dataclass_from_args(QualityConfig, parser.parse_args())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ev = Evaluator(config)
    with tempfile.TemporaryDirectory(prefix="quality-") as tmp:
        runs = [
            run_single(config, ev),
            run_sync(config, ev, Path(tmp)),
            run_async(config, ev, Path(tmp)),
        ]
    sync_loss = runs[1]["val_loss"]
    for run in runs:
        run["ratio_to_sync_diloco"] = round(run["val_loss"] / sync_loss, 4)
        print(
            f"{run['method']:<12} val loss {run['val_loss']:.4f}  "
            f"ratio to sync DiLoCo {run['ratio_to_sync_diloco']:.4f}  tokens {run['tokens']:,}"
        )
    print(
        json.dumps(
            {
                "benchmark": "quality",
                "config": asdict(config),
                "runs": runs,
                "initial_val_loss": ev.val_loss(_genesis(config, ev)),
                "async_within_3pct": abs(runs[2]["ratio_to_sync_diloco"] - 1) <= 0.03,
            }
        )
    )


def _genesis(config: QualityConfig, ev: Evaluator) -> torch.Tensor:
    model = build_model(ev.model_config, config.seed)
    return parameters_to_vector(model.parameters()).detach().float()


if __name__ == "__main__":
    main()
