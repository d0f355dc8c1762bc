"""Staleness handling on a virtual clock: arms side by side with no timing noise.

    python -m bench.correction_sim --seeds 0,1,2                                # none vs heloco:10
    python -m bench.correction_sim --seeds 0,1,2 --non-iid                      # data slices
    python -m bench.correction_sim --seeds 0,1,2 --lag 10 --arms none,none@late,none@apply

An in-process replay of an asynchronous swarm of learners at speeds 1 : 2 : 4 (--hetero), each
running H inner steps per round (fixed H, so the slowest learner's updates are the stalest):
the real Learner (inner AdamW), the real DelayedNesterov outer optimizer, the real staleness
weight (merge.weighting) and the real correction (merge.correction), each built from the node's
default settings sections as a node builds them. Only the network and the clock are replaced,
and of `merge.pipeline` only its correct, weigh and step are kept (no trust checks, robust
verdicts or budgets), since an arm's view may give a staleness no header carries. Every learner
keeps its own replica, as a node does: it applies its own update when it publishes it and
starts its next round from that replica; a peer's update reaches it --lag virtual time units
later (units: one inner step of the fastest learner). The schedule of publications and applies
is a pure function of the speeds, H, the horizon and the lag (:func:`schedule`), so every arm
of a seed sees the same updates in the same order and the arms differ only by how they weigh,
correct or start from them. That is what bench.quality cannot give on a loaded machine, where
the merge order and step counts vary run to run.

An arm is ``KIND[:STRENGTH][@VIEW]``:
- KIND: ``none``; ``heloco`` (merge.correction at k_s = STRENGTH, default 10); ``lookahead``
  (merge.correction.look_ahead: a learner starts its round from its replica moved on along
  the outer momentum by as many swarm rounds as its previous round lasted, lr x R x m, STRENGTH
  scaling R; the pseudo-gradient is taken from that start, and replicas apply it as any other);
- VIEW, the staleness the weight and the correction are given: ``signed`` (default: what the
  node signs, the updates its author applied while the round ran, less the M - 1 of its own
  round); ``late`` (those of them whose base is a whole swarm round or more older than the
  author's own base count fully, merge.weighting.rounds_stale's ``late``); ``apply`` (an
  oracle no node has: the updates the receiving replica holds that the author's base lacked,
  at the moment it applies it; replicas then weigh one update differently).

Per seed it prints every arm's final validation loss (the mean over the replicas, which hold
the same updates) and its gain over the first arm; for the first arm, how the updates relate
to the outer momentum they are judged against (stale vs fresh, mean cosine, share of
conflicting blocks) and the mean rounds stale each view gives. The last line is JSON.

The schedule (publications, applies, the views' staleness) is bench.correction_schedule
(session 24, moved unchanged); its names are re-exported here.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

import pydantic.dataclasses
import torch
from torch.nn.utils import parameters_to_vector

from bench.correction_schedule import (
    VIEWS,
    Apply,
    Publication,
    View,
    schedule,
    view_rounds,
    view_staleness,
)
from bench.quality import Evaluator, QualityConfig
from merge.correction import CorrectionConfig, correct, expected_delay, look_ahead
from merge.outer import OuterOptimizer, make_outer_optimizer
from merge.weighting import rounds_weight
from node.config import add_config_arguments, config_from_args
from node.data import ShardSampler, data_slice
from node.settings import FLAGS, MergeSettings, OuterSettings

OUTER = OuterSettings().outer_config("bf16")
"""A node's outer optimizer at its defaults: delayed Nesterov, lr 0.7, momentum 0.9."""
STALENESS = MergeSettings().staleness_config()
"""A node's staleness weight at its defaults: polynomial, (1+s)^-0.5."""
KINDS = ("none", "heloco", "lookahead")
REUNION_RULES = (
    "plain", "reset", "scale", "avg", "claim1", "claim1plain", "claim", "claimplain", "seen",
    "zeroplain",
)  # fmt: skip
"""How a partition's backlog is taken (``+RULE`` of an arm, module doc). Oracles (they know
which updates a partition held back, and how many partitions there were): ``plain`` applies
the backlog as plain steps (no momentum built, no share of a round, as a flush);
``reset`` zeroes a replica's outer momentum before its first backlog update; ``scale``
weighs the backlog by 1 / partitions; ``avg`` scales the backlog so and also takes back
(1 - 1 / partitions) of the replica's own move since the partition began, as a synchronous
round of the partitions would average them. Signed data only (every replica weighs alike):
``claim`` weighs every update by its author's signed learner count over the count it is
sized by, M (an author alone signs 1 + the other authors among its last max(8, 2) applied
updates, as node.network_swarm.live_learners counts them with no peer alive: 4 falling to 1
over its first 8 updates alone); ``claimplain`` applies updates signed with fewer learners
than M as plain steps; ``claim1`` and ``claim1plain`` the same with an author alone signing
1 from its first update alone (an ideal count); ``seen`` weighs by (staleness + 1) / M, the
share of a round its author saw while it trained (an author alone sees none);
``zeroplain`` applies updates signed with staleness 0 (their author applied no one's while
its round ran) as plain steps, wherever they are applied."""


@pydantic.dataclasses.dataclass(kw_only=True, config=FLAGS)
class SimConfig:
    """Virtual-clock replay settings."""

    hetero: str = "1,2,4"
    """Slow-down factors, one learner each."""
    inner_steps: int = 10
    """H: every learner's steps per round."""
    horizon: float = 200.0
    """Virtual time, in steps of the fastest learner: rounds ending later are not published."""
    lag: float = 0.0
    """Virtual time a published update takes to reach the other learners' replicas."""
    partition: str = ""
    """START:END (virtual time): every learner alone meanwhile (the NAT bench's public node
    down: no update reaches another replica); what was held back arrives at END."""
    rotate: bool = False
    """At END replica j takes author j + 1's held-back updates first, then j + 2's, ... (not
    every replica in publication order): measures what a rule weighing by arrival does."""
    seeds: str = "0"
    """Comma-separated genesis seeds."""
    arms: str = "none,heloco:10"
    """Comma-separated arms KIND[:STRENGTH][@VIEW] (module doc); gains are over the first."""
    non_iid: bool = False
    """Learner i trains only on the i-th of M contiguous slices of the corpus."""


@dataclass(frozen=True)
class Arm:
    """One way of handling stale updates."""

    kind: str
    strength: float
    view: View
    rules: tuple[str, ...] = ()
    """REUNION_RULES applied, in the order given."""

    @classmethod
    def parse(cls, text: str) -> Arm:
        text, *rules = text.split("+")
        if any(rule not in REUNION_RULES for rule in rules):
            raise ValueError(f"an arm's +RULE is one of {REUNION_RULES}")
        arm = cls._parse(text)
        return cls(arm.kind, arm.strength, arm.view, tuple(rules))

    @classmethod
    def _parse(cls, text: str) -> Arm:
        spec, _, view = text.partition("@")
        kind, _, strength = spec.partition(":")
        if kind not in KINDS or (view or "signed") not in VIEWS:
            raise ValueError(f"an arm is KIND[:STRENGTH][@VIEW], KIND in {KINDS}, VIEW in {VIEWS}")
        try:
            value = float(strength) if strength else (10.0 if kind == "heloco" else 1.0)
        except ValueError:
            raise ValueError(f"arm {text!r}: the strength must be a number") from None
        return cls(kind, value, view or "signed")  # type: ignore[arg-type]

    @property
    def correction(self) -> CorrectionConfig:
        if self.kind == "none":
            return CorrectionConfig()
        return CorrectionConfig(kind=self.kind, strength=self.strength)  # type: ignore[arg-type]

    def __str__(self) -> str:
        return f"{self.kind}:{self.strength:g}@{self.view}" + "".join(f"+{r}" for r in self.rules)


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


class Reunion:
    """How one arm takes a partition's backlog (REUNION_RULES), replica by replica."""

    def __init__(
        self, rules: tuple[str, ...], learners: int, partition: tuple[float, float] | None
    ) -> None:
        self.rules, self.learners, self.partition = rules, learners, partition
        self.parts = learners if partition is not None else 1
        """Partitions while it lasts: every learner alone (the NAT bench's homes)."""
        self._start: dict[int, torch.Tensor] = {}
        self._met: set[int] = set()

    def snapshot(self, event: Apply, params: list[torch.Tensor]) -> None:
        """Keeps each replica's params as the partition begins (``avg`` takes back its move)."""
        p = self.partition
        if "avg" in self.rules and p is not None and event.time >= p[0]:
            self._start.setdefault(event.replica, params[event.replica].clone())

    def first_backlog(self, event: Apply) -> bool:
        if not event.held_back or event.replica in self._met:
            return False
        self._met.add(event.replica)
        return True

    def start(self, replica: int, params: torch.Tensor, outer: OuterOptimizer) -> OuterOptimizer:
        """Before a replica's first backlog update: ``avg`` moves it back toward where the
        partition began, ``reset`` gives it a fresh outer optimizer (no momentum)."""
        if "avg" in self.rules and replica in self._start:
            params.sub_((params - self._start[replica]) * (1 - 1 / self.parts))
        if "reset" in self.rules:
            return make_outer_optimizer(OUTER, params.numel())
        return outer

    def factor(self, pub: Publication, event: Apply) -> float:
        """What the rules multiply an apply's weight by."""
        factor = 1.0
        if event.held_back and ("scale" in self.rules or "avg" in self.rules):
            factor /= self.parts
        if "claim1" in self.rules and pub.alone:
            factor /= self.learners  # signed 1, sized by the swarm's M
        if "claim" in self.rules:
            factor *= min(1.0, pub.claim / self.learners)
        if "seen" in self.rules:
            factor *= min(1.0, (pub.staleness + 1) / self.learners)
        return factor

    def plain(self, pub: Publication, event: Apply) -> bool:
        """Whether the apply is a plain step (no momentum built, no share of a round)."""
        return (
            ("plain" in self.rules and event.held_back)
            or ("claim1plain" in self.rules and pub.alone)
            or ("claimplain" in self.rules and pub.claim < self.learners)
            or ("zeroplain" in self.rules and pub.staleness == 0 and self.learners > 1)
        )


def settled(params: torch.Tensor, outer: OuterOptimizer) -> torch.Tensor:
    """Where the replica settles once its momentum has played out (merge.outer.rest_terms)."""
    point = params.clone()
    for coefficient, buffer in outer.rest_terms():
        point.add_(buffer, alpha=coefficient)
    return point


def drift(points: list[torch.Tensor]) -> float:
    """The largest distance between two replicas' points, relative to their mean norm."""
    scale = sum(float(p.norm()) for p in points) / len(points)
    far = max(float((a - b).norm()) for a in points for b in points)
    return round(far / max(scale, 1e-12), 6)


def _mean(values: list[float]) -> float:
    return round(sum(values) / max(1, len(values)), 4)


def replay(config: SimConfig, seed: int, arm: Arm, events: list[Publication | Apply]) -> dict:
    """One arm over a schedule: the mean final validation loss over the replicas and how the
    updates sat against the outer momentum (the authors' replicas' view)."""
    speeds = [float(f) for f in config.hetero.split(",")]
    num = len(speeds)
    torch.manual_seed(seed)
    ev = Evaluator(QualityConfig(seed=seed))
    learners = [ev.learner(int(config.horizon), f"sim/{seed}/{i}") for i in range(num)]
    if config.non_iid:
        for i, learner in enumerate(learners):
            shard = data_slice(ev.split.train, f"{i}/{num}")
            learner.sampler = ShardSampler(
                shard, seed=f"sim/{seed}/{i}", batch_size=ev.batch_size,
                block_size=ev.model_config.block_size,
            )  # fmt: skip
    genesis = parameters_to_vector(learners[0].model.parameters()).detach().float().clone()
    params = [genesis.clone() for _ in speeds]
    outers = [make_outer_optimizer(OUTER, genesis.numel()) for _ in speeds]
    bases = [genesis.clone() for _ in speeds]
    for learner in learners:
        learner.load_params(genesis)
    pubs: dict[int, Publication] = {}
    updates: dict[int, torch.Tensor] = {}
    pending: dict[int, int] = {}
    stale, fresh, removed, rounds = Alignment(), Alignment(), [], []
    correction, block = arm.correction, CorrectionConfig().block
    reunion = Reunion(arm.rules, num, parse_partition(config))
    for event in events:
        if isinstance(event, Publication):
            learner = learners[event.author]
            learner.run_round(config.inner_steps, lambda: False, lambda _: None)
            updates[event.index] = bases[event.author] - learner.params_vector()
            pubs[event.index], pending[event.index] = event, num
            continue
        pub, j = pubs[event.publication], event.replica
        reunion.snapshot(event, params)
        update, outer = updates[event.publication], outers[j]
        staleness = view_staleness(arm.view, pub, event)
        r = view_rounds(arm.view, pub, event, num)
        momentum = outer.momentum_buffer
        if j == pub.author:
            rounds.append(r)
            (stale if r > 0 else fresh).add(update, momentum, block)
        corrected = correct(correction, update, staleness, momentum).pseudo_gradient
        if j == pub.author:
            removed.append(float((corrected - update).norm() / update.norm()))
        weight = rounds_weight(STALENESS, r) * reunion.factor(pub, event)
        if reunion.first_backlog(event):
            outers[j] = outer = reunion.start(j, params[j], outer)
        if reunion.plain(pub, event):
            outer.plain_step(params[j], corrected, weight, num)
        else:
            outer.step(params[j], corrected, weight, num)
        pending[pub.index] -= 1
        if not pending[pub.index]:
            del updates[pub.index]
        if j == pub.author:  # its next round starts from its replica
            delay = expected_delay(pub.staleness, num)
            start = look_ahead(correction, params[j], outer.momentum_buffer, delay, OUTER.lr)
            bases[j] = start.clone()
            learners[j].load_params(bases[j])
    losses = [ev.val_loss(p) for p in params]
    return {
        "arm": str(arm),
        "val_loss": _mean(losses),
        "replica_val_losses": losses,
        "drift": drift(params),
        "settled_drift": drift([settled(p, o) for p, o in zip(params, outers, strict=True)]),
        "updates": len(pubs),
        "mean_rounds_stale": _mean(rounds),
        "stale": stale.summary(),
        "fresh": fresh.summary(),
        "mean_share_removed": _mean(removed),
    }


def staleness_views(events: list[Publication | Apply], learners: int) -> dict[str, float]:
    """Mean rounds stale of every apply under each view: how much the signed count misses."""
    pubs = {e.index: e for e in events if isinstance(e, Publication)}
    applies = [e for e in events if isinstance(e, Apply)]
    return {
        view: _mean([view_rounds(view, pubs[a.publication], a, learners) for a in applies])
        for view in VIEWS
    }


def parse_partition(config: SimConfig) -> tuple[float, float] | None:
    """--partition START:END as a pair (None if empty); ValueError if malformed."""
    if not config.partition:
        return None
    start, sep, end = config.partition.partition(":")
    try:
        window = (float(start), float(end))
    except ValueError:
        raise ValueError("--partition is START:END, two numbers") from None
    if not sep or not 0 <= window[0] < window[1]:
        raise ValueError("--partition is START:END with 0 <= START < END")
    return window


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser, SimConfig)
    config = config_from_args(SimConfig, parser.parse_args())
    torch.set_num_threads(1)
    try:
        arms = [Arm.parse(a) for a in config.arms.split(",")]
        speeds = [float(f) for f in config.hetero.split(",")]
        events = schedule(
            speeds, config.inner_steps, config.horizon, config.lag, parse_partition(config),
            config.rotate,
        )  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    views = staleness_views(events, len(speeds))
    print(f"mean rounds stale per apply: {views}")
    per_seed: list[dict] = []
    for seed in [int(s) for s in config.seeds.split(",")]:
        runs = [replay(config, seed, arm, events) for arm in arms]
        base = runs[0]["val_loss"]
        for run in runs:
            run["gain"] = round(1 - run["val_loss"] / base, 4)
        losses = ", ".join(f"{r['arm']} {r['val_loss']:.4f} ({r['gain']:+.2%})" for r in runs)
        first = runs[0]
        print(f"seed {seed}: {losses}; {arms[0]} stale {first['stale']}, fresh {first['fresh']}")
        per_seed.append({"seed": seed, "runs": runs})
    gains = [[run["gain"] for run in s["runs"]] for s in per_seed]
    mean_gain = {str(arm): _mean([g[k] for g in gains]) for k, arm in enumerate(arms)}
    print(f"mean gain over {arms[0]}: {mean_gain}")
    print(json.dumps({
        "benchmark": "correction_sim", "non_iid": config.non_iid, "lag": config.lag,
        "hetero": config.hetero, "inner_steps": config.inner_steps, "horizon": config.horizon,
        "rounds_stale_per_view": views, "mean_gain": mean_gain, "per_seed": per_seed,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
