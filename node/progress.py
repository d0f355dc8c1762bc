"""A round's inner steps so far: what a stopped node keeps so that resuming redoes none; a
finished round, published at once or set aside while the swarm is not entered (`round_end`);
the marks and the steps of the round running (`RoundClock`, `Segment`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

from node.learner import RoundStats, StepStats


@dataclass(frozen=True)
class RoundProgress:
    """Where the current round stands; with `params` it can be finished after a restart."""

    base: torch.Tensor
    """The replica the round started from: the pseudo-gradient is base - params."""
    base_applied: int
    """Updates in that replica (the staleness of the update is counted from it)."""
    steps_done: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    inner_s: float = 0.0
    """Seconds of inner steps so far (across restarts), with the loop's own work between
    them (the partial saves' copies, the DHT's fork, starting what runs beside training)."""
    steps_s: float = 0.0
    """Of inner_s, the seconds inside the inner steps themselves: what the steps computed."""
    params: torch.Tensor | None = None
    """Inner parameters after `steps_done` steps; None for a round not begun."""

    def extended(self, stats: RoundStats, seconds: float) -> RoundProgress:
        """This progress plus the steps of `stats` (params are taken separately, if needed)."""
        loss_sum = stats.loss * stats.num_steps if stats.num_steps else 0.0
        return replace(
            self,
            steps_done=self.steps_done + stats.num_steps,
            tokens=self.tokens + stats.tokens,
            loss_sum=self.loss_sum + loss_sum,
            inner_s=self.inner_s + seconds,
            steps_s=self.steps_s + stats.compute_s,
        )

    def as_round_stats(self) -> RoundStats:
        return RoundStats(
            num_steps=self.steps_done,
            tokens=self.tokens,
            loss=self.loss_sum / max(self.steps_done, 1),
            compute_s=self.steps_s,
        )

    def state_dict(self) -> dict[str, Any]:
        """Loadable with torch.load(weights_only=True)."""
        if self.params is None:
            raise ValueError("a round without inner parameters cannot be saved")
        return {
            "base": self.base,
            "base_applied": self.base_applied,
            "steps_done": self.steps_done,
            "tokens": self.tokens,
            "loss_sum": self.loss_sum,
            "inner_s": self.inner_s,
            "steps_s": self.steps_s,
            "params": self.params,
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any], numel: int, max_steps: int) -> RoundProgress:
        """ValueError unless the saved round fits this model and has at most `max_steps`."""
        base, params = state["base"], state["params"]
        for name, tensor in (("base", base), ("params", params)):
            ok = isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32
            if not ok or tensor.shape != (numel,):
                raise ValueError(f"partial round {name} is not an fp32 vector of {numel}")
        steps, tokens, applied = state["steps_done"], state["tokens"], state["base_applied"]
        if not all(type(v) is int and v >= 0 for v in (steps, tokens, applied)):
            raise ValueError("partial round counters must be non-negative integers")
        # max_steps: a finished round stopped while it waited for the swarm, to be published.
        if not 0 < steps <= max_steps:
            raise ValueError(f"partial round has {steps} steps; a round has {max_steps}")
        return cls(
            base=base,
            base_applied=applied,
            steps_done=steps,
            tokens=tokens,
            loss_sum=float(state["loss_sum"]),
            inner_s=float(state["inner_s"]),
            # Saved before steps_s was: the steps' share of inner_s was not kept.
            steps_s=float(state.get("steps_s", state["inner_s"])),
            params=params,
        )


@dataclass(frozen=True)
class FinishedRound:
    """A round whose inner steps are done, as it ended: published at once, or set aside
    while the swarm is not entered yet, the next round training meanwhile (node.trainer)."""

    begun: RoundProgress
    """Where the round started in this process (a resumed round: the progress it resumed)."""
    done: RoundProgress
    """The round as it ended; set aside, with its end parameters (what it publishes: base -
    params), else `params` is what it resumed from, if anything."""
    started: float
    """perf_counter at the round's start in this process."""
    ended: float
    """perf_counter at its last inner step's end."""
    planned_steps: int
    learner_step: int
    """The learner's step count at its end (the next round moves it on)."""


RoundEnd = Literal["publish", "set_aside", "wait"]


def round_end(*, caught_up: bool, aside_waiting: bool, may_set_aside: bool) -> RoundEnd:
    """What a round whose steps are done does: published at once once the swarm is entered
    and the state checked (after the round set aside before it, if any); else set aside so
    that the next round starts without waiting, unless one already waits (one at most: each
    round set aside is one more stale base, and a model-sized vector held) or no round comes
    after this one (`may_set_aside` False: the last round, a stopping node, fragments, which
    publish during the round, or a round run by hand); else it waits for the swarm."""
    if caught_up:
        return "publish"
    if aside_waiting or not may_set_aside:
        return "wait"
    return "set_aside"


@dataclass
class RoundClock:
    """perf_counter marks of one round: its start, end of inner steps, of merging, and of
    handing its replica to evaluation (a snapshot; the evaluation runs beside training)."""

    start: float
    inner: float = 0.0
    merged: float = 0.0
    evaluated: float = 0.0


@dataclass
class Segment:
    """The inner steps this process ran of the current round so far (a round resumed from a
    checkpoint continues what `begun` holds)."""

    begun: RoundProgress
    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens: int = 0
    loss_sum: float = 0.0
    steps_s: float = 0.0

    def add(self, step: StepStats) -> None:
        self.steps, self.tokens = self.steps + 1, self.tokens + step.tokens
        self.loss_sum += step.loss
        self.steps_s += step.seconds

    def progress(self) -> RoundProgress:
        elapsed = time.perf_counter() - self.start
        mean_loss = self.loss_sum / max(self.steps, 1)
        return self.begun.extended(
            RoundStats(self.steps, self.tokens, mean_loss, self.steps_s), elapsed
        )


def remaining_s(limit_s: float | None, spent_s: float) -> float | None:
    """What is left of a round's time limit after `spent_s` (None: no limit)."""
    return None if limit_s is None else max(limit_s - spent_s, 0.0)
