"""Staleness correction on a virtual clock: corrected vs uncorrected with no timing noise.

    python -m bench.correction_sim --seeds 0,1,2 --strength 10             # IID learners
    python -m bench.correction_sim --seeds 0,1,2 --strength 10 --non-iid   # data slices

An in-process replay of an asynchronous swarm of learners at speeds 1 : 2 : 4 (--hetero), each
running H inner steps per round (fixed H, so the slowest learner's updates are the stalest):
the real Learner (inner AdamW), the real DelayedNesterov outer optimizer, the real staleness
weight (merge.weighting) and the real correction (merge.correction). Only the network and the
clock are replaced: a learner's round ends at virtual time (round start + H x its factor) and
its update is applied in that order, so two runs of one seed see the same updates in the same
order and differ only by the correction. That is what bench.quality cannot give on a loaded
machine, where the merge order and step counts vary run to run.

Per seed it prints both final validation losses and, for the uncorrected run, how the updates
relate to the outer momentum they are judged against: the mean cosine of stale updates (at
least one swarm round stale) and fresh ones, and the share of conflicting (negative-cosine)
blocks in each. The last line is JSON.
"""

from __future__ import annotations

import argparse
import heapq
import json
from dataclasses import dataclass, field

import torch
from torch.nn.utils import parameters_to_vector

from bench.quality import Evaluator, QualityConfig
from merge.correction import CorrectionConfig, correct
from merge.outer import DelayedNesterov
from merge.weighting import StalenessConfig, rounds_stale, staleness_weight
from node.config import add_dataclass_arguments, dataclass_from_args
from node.data import ShardSampler, data_slice


@dataclass(kw_only=True)
class SimConfig:
    """Virtual-clock replay settings."""

    hetero: str = "1,2,4"
    """Slow-down factors, one learner each."""
    inner_steps: int = 10
    """H: every learner's steps per round."""
    horizon: float = 200.0
    """Virtual time, in steps of the fastest learner: rounds ending later are not applied."""
    seeds: str = "0"
    """Comma-separated genesis seeds."""
    strength: float = 10.0
    """The corrected run's HeLoCo shrinkage strength k_s."""
    non_iid: bool = False
    """Learner i trains only on the i-th of M contiguous slices of the corpus."""


@dataclass
class Alignment:
    """How merged updates relate to the outer momentum (cosines against it)."""

    cosines: list[float] = field(default_factory=list)
    conflicting_blocks: int = 0
    blocks: int = 0

    def add(self, g: torch.Tensor, m: torch.Tensor, block: int) -> None:
        if not bool(m.any()):
            return
        self.cosines.append(float(g @ m / (g.norm() * m.norm())))
        pad = -g.numel() % block
        gb = torch.nn.functional.pad(g, (0, pad)).view(-1, block)
        mb = torch.nn.functional.pad(m, (0, pad)).view(-1, block)
        self.conflicting_blocks += int(((gb * mb).sum(dim=1) < 0).sum())
        self.blocks += gb.shape[0]

    def summary(self) -> dict[str, float | int]:
        n = len(self.cosines)
        return {
            "updates": n,
            "mean_cosine": round(sum(self.cosines) / n, 3) if n else 0.0,
            "conflicting_block_share": round(self.conflicting_blocks / max(1, self.blocks), 3),
        }


def replay(config: SimConfig, seed: int, correction: CorrectionConfig) -> dict:
    """One virtual-clock run: the final validation loss and the updates' alignment."""
    speeds = [float(f) for f in config.hetero.split(",")]
    horizon, steps = config.horizon, config.inner_steps
    torch.manual_seed(seed)
    ev = Evaluator(QualityConfig(seed=seed))
    learners = [ev.learner(int(horizon), f"sim/{seed}/{i}") for i in range(len(speeds))]
    if config.non_iid:
        for i, learner in enumerate(learners):
            shard = data_slice(ev.split.train, f"{i}/{len(speeds)}")
            learner.sampler = ShardSampler(
                shard, seed=f"sim/{seed}/{i}", batch_size=ev.batch_size,
                block_size=ev.model_config.block_size,
            )  # fmt: skip
    params = parameters_to_vector(learners[0].model.parameters()).detach().float().clone()
    outer = DelayedNesterov(lr=0.7, momentum=0.9, numel=params.numel())
    num_learners, applied = len(speeds), 0
    queue: list[tuple[float, int, torch.Tensor, int]] = []
    for i, factor in enumerate(speeds):
        learners[i].load_params(params)
        heapq.heappush(queue, (steps * factor, i, params.clone(), 0))
    stale, fresh, removed = Alignment(), Alignment(), []
    while queue:
        end, i, base, applied_at_start = heapq.heappop(queue)
        if end > horizon:
            continue
        learner = learners[i]
        learner.run_round(steps, lambda: False, lambda _: None)
        update = base - learner.params_vector().detach().float()
        staleness = applied - applied_at_start
        momentum = outer.momentum_buffer
        is_stale = rounds_stale(staleness, num_learners) > 0
        (stale if is_stale else fresh).add(update, momentum, correction.block)
        corrected = correct(correction, update, staleness, momentum).pseudo_gradient
        removed.append(float((corrected - update).norm() / update.norm()))
        weight = staleness_weight(StalenessConfig(), staleness, num_learners)
        outer.step(params, corrected, weight, num_learners)
        applied += 1
        learner.load_params(params)
        heapq.heappush(queue, (end + steps * speeds[i], i, params.clone(), applied))
    return {
        "val_loss": ev.val_loss(params),
        "updates": applied,
        "stale": stale.summary(),
        "fresh": fresh.summary(),
        "mean_share_removed": round(sum(removed) / max(1, len(removed)), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_dataclass_arguments(parser, SimConfig)
    config: SimConfig = dataclass_from_args(SimConfig, parser.parse_args())
    torch.set_num_threads(1)
    corrected_config = CorrectionConfig(kind="heloco", strength=config.strength)
    per_seed = []
    for seed in [int(s) for s in config.seeds.split(",")]:
        plain = replay(config, seed, CorrectionConfig())
        corrected = replay(config, seed, corrected_config)
        gain = round(1 - corrected["val_loss"] / plain["val_loss"], 4)
        losses = f"uncorrected {plain['val_loss']:.5f}, corrected {corrected['val_loss']:.5f}"
        print(
            f"seed {seed}: {losses} (gain {gain:+.2%}); "
            f"stale updates {plain['stale']}, fresh {plain['fresh']}"
        )
        per_seed.append({"seed": seed, "gain": gain, "uncorrected": plain, "corrected": corrected})
    gains = [s["gain"] for s in per_seed]
    print(json.dumps({
        "benchmark": "correction_sim", "non_iid": config.non_iid, "strength": config.strength,
        "mean_gain": round(sum(gains) / len(gains), 4), "gain_per_seed": gains,
        "per_seed": per_seed,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
