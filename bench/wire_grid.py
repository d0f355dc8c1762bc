"""`python -m bench.wire --grid`: each codec's quality against bf16's across M and H.

    python -m bench.wire --grid                               # M = 2,4,8 x H = 10,25,100
    python -m bench.wire --grid --grid-learners 2,8 --grid-inner-steps 10,100 --grid-jobs 2

For every (M, H) of the grid, M learners train the `--train-model` for `--grid-steps` inner
steps each (rounds = grid-steps / H, at least `--grid-min-rounds`) through the real publish
path of bench.wire.train (error feedback, encode, seal, verify, decode, weigh, apply), once
per codec, on the same data in the same order: equal tokens. A row per (codec, M, H) gives
the final validation loss, its ratio to bf16's in the same cell, and the codec's bytes
against data-parallel training's at that M and H for the `--model` size (and at bench.wire's
reference M = `--learners`, H = `--inner-steps`). Cells run in `--grid-jobs` processes of
one torch thread each. The learners stop as nodes do (each flushes its error feedback residual
once, dense, marked as a flush: a plain outer step, no momentum): val_loss is after that,
before_flush_ratio_vs_bf16 before it, and bytes_ratio_vs_dp_with_flush counts the flush over
the cell's rounds. The final line is JSON.
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from itertools import product

import torch

from bench.quality import Evaluator, QualityConfig
from bench.wire import (
    WireConfig,
    dp_bytes_per_step,
    flush_bytes_per_step,
    swarm_bytes_per_step,
    train,
    wire_bytes,
)

ONE_PERCENT = 1.01


def int_list(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def cell_rounds(config: WireConfig, h: int) -> int:
    """Rounds of a cell: `grid_steps` inner steps per learner, at least `grid_min_rounds`."""
    return max(config.grid_min_rounds, config.grid_steps // h)


def bytes_ratio(codec: str, numel: int, learners: int, h: int, flush_rounds: int = 0) -> float:
    """DP's bytes over the swarm's per learner per inner step (bench.wire's model of both);
    with `flush_rounds`, counting each learner's dense flush at the end of that many rounds."""
    envelope, announcement = wire_bytes(codec, numel, h, learners)
    swarm = swarm_bytes_per_step(envelope, announcement, learners, h)
    if flush_rounds:
        swarm += flush_bytes_per_step(numel, learners, h, flush_rounds)
    return round(dp_bytes_per_step(numel, learners) / swarm, 1)


def train_cell(config: WireConfig, codec: str, learners: int, h: int) -> dict:
    """One (codec, M, H) training run at equal tokens; runs in a worker process."""
    torch.set_num_threads(1)
    cell = replace(
        config, train_learners=learners, train_inner_steps=h, train_rounds=cell_rounds(config, h)
    )
    ev = Evaluator(QualityConfig(model=cell.train_model, eval_batches=cell.eval_batches, seed=0))
    trained = train(codec, replace(cell, eval_every=0), ev)
    return {
        "codec": codec,
        "learners": learners,
        "inner_steps": h,
        "rounds": cell.train_rounds,
        "val_loss": trained.curve[cell.train_rounds],
        "robust_clipped": trained.robust,
        "val_loss_unlagged": trained.val_loss_unlagged,
        "val_loss_before_flush": trained.val_loss_before_flush,
        "flush_updates": trained.flush_updates,
        "train_seconds": round(trained.seconds, 1),
    }


def run_grid(config: WireConfig, codecs: list[str], numel: int) -> dict:
    cells = list(product(int_list(config.grid_learners), int_list(config.grid_inner_steps)))
    jobs = [(config, codec, m, h) for m, h in cells for codec in codecs]
    reference = {codec: bytes_ratio(codec, numel, config.learners, config.inner_steps)
                 for codec in codecs}  # fmt: skip
    bf16_loss: dict[tuple[int, int], float] = {}
    rows = []
    with ProcessPoolExecutor(max_workers=config.grid_jobs) as pool:
        for r in pool.map(train_cell, *zip(*jobs, strict=True)):  # bf16 first in each cell
            cell = (r["learners"], r["inner_steps"])
            bf16_loss.setdefault(cell, r["val_loss"])
            row = {
                **r,
                "val_loss_ratio_vs_bf16": round(r["val_loss"] / bf16_loss[cell], 5),
                "unlagged_ratio_vs_bf16": round(r["val_loss_unlagged"] / bf16_loss[cell], 5),
                "before_flush_ratio_vs_bf16": round(
                    r["val_loss_before_flush"] / bf16_loss[cell], 5
                ),
                "bytes_ratio_vs_dp": bytes_ratio(r["codec"], numel, *cell),
                "bytes_ratio_vs_dp_with_flush": bytes_ratio(
                    r["codec"], numel, *cell, r["rounds"] if r["flush_updates"] else 0
                ),
                "bytes_ratio_vs_dp_at_reference": reference[r["codec"]],
            }
            rows.append(row)
            print(describe(row, config), flush=True)
    worst = {c: max(r["val_loss_ratio_vs_bf16"] for r in rows if r["codec"] == c) for c in codecs}
    return {
        "benchmark": "wire_grid",
        "config": asdict(config),
        "num_params": numel,
        "rows": rows,
        "worst_val_loss_ratio_vs_bf16": worst,
        "within_1_percent": {codec: worst[codec] <= ONE_PERCENT for codec in codecs},
    }


def describe(row: dict, config: WireConfig) -> str:
    return (
        f"{row['codec']:>6} M={row['learners']} H={row['inner_steps']:>3} "
        f"rounds={row['rounds']:>2}: val loss {row['val_loss']:.4f} "
        f"({row['val_loss_ratio_vs_bf16']:.4f} of bf16 after the flush, "
        f"{row['before_flush_ratio_vs_bf16']:.4f} before it, {row['unlagged_ratio_vs_bf16']:.4f} "
        f"with the residuals in), {row['bytes_ratio_vs_dp']}x less than DP here "
        f"({row['bytes_ratio_vs_dp_with_flush']}x with the flush over {row['rounds']} rounds), "
        f"{row['bytes_ratio_vs_dp_at_reference']}x at M={config.learners} "
        f"H={config.inner_steps}, robust verdicts {row['robust_clipped']} "
        f"({row['train_seconds']} s)"
    )


def main_grid(config: WireConfig, numel: int) -> None:
    codecs = config.grid_codecs.split(",")
    if codecs[0] != "bf16":
        raise SystemExit("--grid-codecs: bf16 first (the quality reference)")
    print(json.dumps(run_grid(config, codecs, numel)))
