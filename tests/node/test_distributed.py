"""A multi-process node (gloo, 2 ranks on the CPU) computes the single-process pseudo-gradient."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from node.data import ShardSampler
from node.distributed import PARALLEL_CHOICES, ShardedLearner, follow
from node.learner import InnerConfig, Learner
from node.model import build_model, model_config

INNER = InnerConfig(lr=3e-3, weight_decay=0.1, grad_clip=1.0, warmup_steps=2, decay_steps=10)
NUM_STEPS = 3
GLOBAL_BATCH = 4


def _sampler() -> ShardSampler:
    tokens = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16)
    return ShardSampler(tokens, seed="node", batch_size=GLOBAL_BATCH, block_size=32)


def _genesis() -> tuple[torch.nn.Module, torch.Tensor]:
    """The tiny model in float64: the comparison sees the algorithm, not fp32 summation order
    (which AdamW's first steps amplify to ~2e-5 relative for any change of batch split)."""
    model = build_model(model_config("tiny"), seed=0)
    base = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    return model.double(), base


def _rank(rank: int, world_size: int, tmp: str) -> None:
    """Both ways of sharing the model, one after the other, in one pair of processes; then
    the rank exits at once, as a follower of a node does (node.multigpu._exit_follower): the
    modules still hold their gloo groups, whose threads torn down in the interpreter's
    finalization are the likeliest cause of rank 1's abort once in CI (SIGABRT, "terminate
    called without an active exception"; session 17)."""
    torch.set_num_threads(1)
    for parallel in PARALLEL_CHOICES:
        dist.init_process_group(
            "gloo", init_method=f"file://{tmp}/rendezvous-{parallel}", rank=rank, world_size=2
        )
        _one_node(rank, parallel, Path(tmp) / f"{parallel}.pt")
    os._exit(0)


def _one_node(rank: int, parallel: str, out: Path) -> None:
    model, base = _genesis()
    learner = ShardedLearner(model, _sampler(), INNER, torch.device("cpu"), parallel=parallel)
    if rank != 0:
        follow(learner)
        return
    learner.load_params(base)
    stats = learner.run_round(NUM_STEPS, lambda: False, lambda _: None)
    delta = base - learner.params_vector()
    # Rank 0 decides when a round ends, for every rank: at --round-time, or interrupted.
    timed = learner.run_round(50, lambda: False, lambda _: None, max_seconds=1e-9)
    asks = iter([False, False, True])
    interrupted = learner.run_round(50, lambda: next(asks), lambda _: None)
    rounds = [(r.num_steps, r.stopped_early) for r in (timed, interrupted)]
    torch.save({"delta": delta, "tokens": stats.tokens, "rounds": rounds}, out)
    learner.release()  # the other ranks exit only if they took the same steps


def _single_process() -> tuple[torch.Tensor, int]:
    model, base = _genesis()
    learner = Learner(model, _sampler(), INNER, torch.device("cpu"))
    learner.load_params(base)
    stats = learner.run_round(NUM_STEPS, lambda: False, lambda _: None)
    return base - learner.params_vector(), stats.tokens


def test_two_ranks_give_the_single_process_pseudo_gradient(tmp_path: Path) -> None:
    mp.start_processes(_rank, args=(2, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    expected, tokens = _single_process()
    for parallel in PARALLEL_CHOICES:
        ranked = torch.load(tmp_path / f"{parallel}.pt", weights_only=True)
        relative = (ranked["delta"] - expected).norm() / expected.norm()
        assert relative < 1e-5, (parallel, relative)
        assert ranked["tokens"] == tokens == NUM_STEPS * GLOBAL_BATCH * 32
        assert ranked["rounds"] == [(1, False), (2, True)], parallel
