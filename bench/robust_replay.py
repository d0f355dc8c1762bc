"""Replays an open swarm's merge with an adversary: honest learners train a small GPT on the
embedded corpus (each the node's own Learner: its inner AdamW, clip, schedule and sampler),
their pseudo-gradients go through the real UpdatePipeline with an attacker's valid, signed
updates interleaved, and the replica's validation loss is compared with the clean replay's
(issue 20). The honest updates are sealed here, not by node.publishing: the replay sets the
learner counts they claim (`--live-claims` or the fixed count) and signs against the shared
replica's num_applied.

Attacks (each against the same honest learners, seeds and data):
- sideways: near-cap updates (just under the reference-norm bound) at cosine -0.45 to the
  momentum (just above the refusal bound), `--rate` per honest update;
- zero_flood: all-zero updates, 40 per round;
- sybil: 40 fresh keys claiming 1,024 learners, each publishing a small honest-looking update
  every round (the divisor of honest updates is reported).

The stranger arrives in round `--start` of an established swarm (three honest learners).

    PYTHONPATH=$PWD python -m bench.robust_replay --rounds 40

Prints one JSON line per attack and a final JSON line with every ratio. Sequential and
single-threaded: deterministic for given seeds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from merge.codecs import get_codec
from merge.envelope import SignedUpdate, seal
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.result import MergeResult
from merge.weighting import TokenWeightConfig
from node.builders import inner_config
from node.data import ShardSampler, load_corpus, split_corpus
from node.learner import Learner
from node.model import ModelConfig, build_model
from node.settings import TrainSettings

FINGERPRINT = hashlib.sha256(b"robust-replay").hexdigest()
MODEL = ModelConfig(n_layer=1, n_head=2, n_embd=48, block_size=32)
BATCH, INNER_STEPS, INNER_LR = 8, 8, 3e-3
TOKENS = BATCH * INNER_STEPS * MODEL.block_size
NUM_SYBILS, ZEROS_PER_ROUND = 40, 40


@dataclass
class Swarm:
    """One replica, its pipeline, and what the replay counts."""

    pipeline: UpdatePipeline
    model: nn.Module
    seqs: dict[str, int] = field(default_factory=dict)
    honest_divisors: list[int] = field(default_factory=list)
    shares: dict[str, float] = field(default_factory=dict)
    """Per author, the round shares its applied updates moved (weight / learners)."""
    authors: set[str] = field(default_factory=set)
    honest: int = 3
    """Honest learners (the attacks spread a round's updates over their updates)."""
    """Every author seen (what a live node counts among its learning peers)."""

    def submitted(self, author: str, result: MergeResult) -> MergeResult:
        self.authors.add(author)
        if result.accepted:
            share = result.weight / max(1, result.learners)
            self.shares[author] = self.shares.get(author, 0.0) + share
        return result

    def claim(self, author: str) -> int:
        """The learner count a live node signs: itself and the others, credited
        (node.swarm_link.live_learners)."""
        return 1 + self.pipeline.credited_learners(self.authors - {author})

    def publish(self, identity: Identity, delta: torch.Tensor, base: int, learners: int) -> bool:
        seq = self.seqs.get(identity.peer_id, 0)
        self.seqs[identity.peer_id] = seq + 1
        update = _seal(identity, delta, seq, base, self.pipeline.replica.num_applied, learners)
        return self.submitted(identity.peer_id, self.pipeline.submit(update)).accepted


def _seal(
    identity: Identity, delta: torch.Tensor, seq: int, base: int, published: int, learners: int
) -> SignedUpdate:
    return seal(
        identity,
        payload=get_codec("fp32").encode(delta.float().contiguous()),
        fingerprint=FINGERPRINT, seq=seq, base_applied=base, published_applied=published,
        inner_steps=INNER_STEPS, tokens=TOKENS, loss=2.0, codec="fp32", numel=delta.numel(),
        created_at=0.0, learners=learners,
    )  # fmt: skip


def make_swarm(seed: int) -> Swarm:
    model = build_model(MODEL, seed)
    params = nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    config = MergeConfig(
        outer=OuterConfig(),
        token_weight=TokenWeightConfig(reference_tokens=TOKENS),
        max_inner_steps=INNER_STEPS,
        max_tokens_per_step=BATCH * MODEL.block_size,
    )
    replica = Replica(params, make_outer_optimizer(config.outer, params.numel()))
    pipeline = UpdatePipeline(replica, config, FINGERPRINT)
    pipeline.clock = lambda: 0.0
    return Swarm(pipeline, model)


def batches(tokens: np.ndarray, seed: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(tokens) - MODEL.block_size - 1, BATCH)
        window = np.stack([tokens[s : s + MODEL.block_size + 1] for s in starts]).astype(np.int64)
        yield torch.from_numpy(window[:, :-1]), torch.from_numpy(window[:, 1:])


def honest_learner(
    split_train: np.ndarray, seed: int, rank: int, learners: int, rounds: int
) -> Learner:
    """One honest learner: the node's Learner (its AdamW, gradient clip, schedule and seeded
    sampler, built by node.builders.inner_config from a train section) on its shard of the
    corpus, with the replay's learning rate, no weight decay and one round of warmup."""
    train = TrainSettings(
        model="tiny", inner_steps=INNER_STEPS, max_rounds=rounds, inner_lr=INNER_LR,
        weight_decay=0.0, warmup_steps=INNER_STEPS,
    )  # fmt: skip
    sampler = ShardSampler(
        np.array_split(split_train, learners)[rank],
        seed=f"robust-replay/{seed}/{rank}",
        batch_size=BATCH,
        block_size=MODEL.block_size,
    )
    return Learner(build_model(MODEL, seed), sampler, inner_config(train), torch.device("cpu"))


def inner_round(learner: Learner, base: torch.Tensor) -> torch.Tensor:
    """H inner steps from `base` (the node's inner loop); the pseudo-gradient base - local."""
    learner.load_params(base)
    learner.run_round(INNER_STEPS, lambda: False, lambda _: None)
    return base - learner.params_vector()


def val_loss(swarm: Swarm, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    nn.utils.vector_to_parameters(swarm.pipeline.replica.params.clone(), swarm.model.parameters())
    with torch.no_grad():
        losses = [float(swarm.model(x, y)[1]) for x, y in val]  # type: ignore[arg-type]
    return sum(losses) / len(losses)


Attack = Callable[[Swarm, int], None]
"""Called after every honest update with the round number."""


def sideways(rate: int) -> Attack:
    mallory = Identity.from_private_bytes(b"m" * 32)
    rng = torch.Generator().manual_seed(7)

    def attack(swarm: Swarm, _round: int) -> None:
        for _ in range(rate):
            pipeline = swarm.pipeline
            reference = _reference(pipeline)
            momentum = pipeline.replica.outer.momentum_direction()
            if momentum is None or reference == 0:
                return
            unit = momentum / momentum.norm()
            noise = torch.randn(unit.numel(), generator=rng)
            noise -= torch.dot(noise, unit) * unit
            cos = -0.45  # just above the refusal bound (min_cosine -0.5)
            g = cos * unit + math.sqrt(1 - cos * cos) * noise / noise.norm()
            norm = 0.99 * pipeline.config.robust.max_norm_to_median * reference
            swarm.publish(mallory, g * norm, pipeline.replica.num_applied, 3)

    return attack


def _reference(pipeline: UpdatePipeline) -> float:
    """The replica's reference norm (an oracle attacker); also on code before issue 20."""
    credited = getattr(pipeline, "_credited", None)
    robust = pipeline.robust
    return (robust.median_norm(credited()) if credited else robust.median_norm()) or 0.0


def zero_flood(swarm: Swarm, _round: int) -> None:
    mallory = Identity.from_private_bytes(b"z" * 32)
    numel = swarm.pipeline.replica.numel
    for _ in range(ZEROS_PER_ROUND // swarm.honest):  # called after each honest update
        claim = swarm.honest + 1
        swarm.publish(mallory, torch.zeros(numel), swarm.pipeline.replica.num_applied, claim)


SYBILS = [
    Identity.from_private_bytes(hashlib.sha256(b"s%d" % i).digest()) for i in range(NUM_SYBILS)
]


def sybil(swarm: Swarm, _round: int) -> None:
    """After each of the 3 honest updates of a round, a third of the 40 keys publish: every
    key once a round, each claiming 1,024 learners."""
    numel = swarm.pipeline.replica.numel
    rng = torch.Generator().manual_seed(len(swarm.seqs))
    part = len(swarm.honest_divisors) % swarm.honest
    for identity in SYBILS[part :: swarm.honest]:
        small = 1e-4 * torch.randn(numel, generator=rng)
        swarm.publish(identity, small, swarm.pipeline.replica.num_applied, 1024)


def replay(
    attack: Attack | None,
    rounds: int,
    seed: int,
    start: int,
    learners: int = 3,
    live_claims: bool = False,
) -> dict[str, float]:
    """`live_claims`: honest learners claim what a live node would (themselves and every
    author seen, credited), not `learners`."""
    split = split_corpus(load_corpus(None), val_tokens=65_536)
    val_data = batches(split.val, seed + 999)
    val = [next(val_data) for _ in range(16)]
    swarm = make_swarm(seed)
    swarm.honest = learners
    honest = [Identity.from_private_bytes(bytes([65 + i]) * 32) for i in range(learners)]
    honest_learners = [
        honest_learner(split.train, seed, i, learners, rounds) for i in range(learners)
    ]
    for round_ in range(rounds):
        base, base_applied = (
            swarm.pipeline.replica.params.clone(),
            swarm.pipeline.replica.num_applied,
        )
        deltas = [inner_round(learner, base) for learner in honest_learners]
        for identity, delta in zip(honest, deltas, strict=True):
            claim = swarm.claim(identity.peer_id) if live_claims else learners
            update = _seal(
                identity, delta, round_, base_applied, swarm.pipeline.replica.num_applied, claim
            )
            result = swarm.submitted(identity.peer_id, swarm.pipeline.submit(update))
            assert result.accepted, result.reason
            swarm.honest_divisors.append(result.learners)
            if attack is not None and round_ >= start:
                attack(swarm, round_)
    divisors = swarm.honest_divisors[start * learners :]
    ids = {i.peer_id for i in honest}
    moved = sum(swarm.shares.values())
    return {
        "val_loss": val_loss(swarm, val),
        "max_honest_divisor": max(divisors),
        "mean_honest_divisor": round(sum(divisors) / len(divisors), 3),
        "stranger_share": round(1 - sum(swarm.shares.get(a, 0.0) for a in ids) / moved, 4),
        "rejections": dict(swarm.pipeline.rejections),  # type: ignore[dict-item]
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--rate", type=int, default=1, help="sideways updates per honest one")
    parser.add_argument("--start", type=int, default=8, help="round the stranger arrives in")
    parser.add_argument("--attacks", default="sideways,zero_flood,sybil", help="comma list")
    parser.add_argument("--honest", type=int, default=3, help="honest learners")
    parser.add_argument(
        "--live-claims", action="store_true", help="honest claims as a live node counts them"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    attacks: dict[str, Attack | None] = {
        "clean": None, "sideways": sideways(args.rate), "zero_flood": zero_flood, "sybil": sybil,
    }  # fmt: skip
    wanted = {"clean", *args.attacks.split(",")}
    if not wanted <= attacks.keys():
        parser.error(f"--attacks must name some of {', '.join(list(attacks)[1:])}.")
    attacks = {name: attack for name, attack in attacks.items() if name in wanted}
    results: dict[str, list[dict[str, float]]] = {}
    for name, attack in attacks.items():
        results[name] = [
            replay(attack, args.rounds, seed, args.start, args.honest, args.live_claims)
            for seed in range(args.seeds)
        ]
        print(json.dumps({"attack": name, "runs": results[name]}), flush=True)
    clean = [r["val_loss"] for r in results["clean"]]
    ratios = {
        name: sum(r["val_loss"] / c for r, c in zip(runs, clean, strict=True)) / len(clean)
        for name, runs in results.items()
    }
    divisor = max(r["max_honest_divisor"] for runs in results.values() for r in runs)
    print(json.dumps({"rounds": args.rounds, "seeds": args.seeds, "start": args.start,
                      "rate": args.rate, "loss_ratio": ratios,
                      "clean_loss": clean, "max_honest_divisor": divisor}))  # fmt: skip


if __name__ == "__main__":
    main()
