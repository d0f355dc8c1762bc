"""The outer optimizer's arithmetic replayed on coefficient vectors over a round's basis, and
the replica's state formed back from the gathered sums (merge.shard_round; docs/scale.md,
Session 16: why it stays linear)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from merge.outer import _ROUND_TOLERANCE, NesterovShares, OuterOptimizer
from merge.shard_round_plan import Formed, Vector

_SAME_COMBO = 1e-9
"""A state's coefficients on the updates this close (relative) to a combination of the
sums gathered already take no sum of their own."""


class Replay:
    """The outer optimizer's arithmetic (merge.outer) replayed on coefficient vectors over
    the basis: each state tensor as a combination of the basis vectors."""

    def __init__(self, outer: OuterOptimizer, num_states: int, num_updates: int) -> None:
        size = num_states + num_updates
        self.kind, self.lr, self.mu = outer.kind, outer.lr, outer.momentum
        self.delay: int | None = getattr(outer, "delay", None)
        self.count, self.progress = outer.round_state()
        self.folds = 0
        unit = np.eye(size)
        self.states = [unit[i].copy() for i in range(num_states)]
        """The params, the momentum (and the delayed optimizer's round sum)."""
        self.num_states = num_states

    def update(self, index: int) -> Vector:
        """The basis vector of the round's `index`-th update."""
        vector = np.zeros(len(self.states[0]))
        vector[self.num_states + index] = 1.0
        return vector

    def momentum_parts(self) -> list[Vector]:
        """As `OuterOptimizer.momentum_parts`."""
        if not self.count:
            return []
        if self.kind != "delayed_nesterov" or self.progress == 0.0:
            return [self.states[1]]
        return [self.states[1], self.states[2]]

    def step(self, vector: Vector, weight: float, learners: int) -> None:
        """As `OuterOptimizer.step` with `vector` as the pseudo-gradient."""
        if self.kind == "delayed_nesterov":
            self._delayed(vector, weight, learners)
        else:
            self._nesterov(vector, weight, learners)
        self.count += 1

    def _delayed(self, vector: Vector, weight: float, learners: int) -> None:
        params, buf, acc = self.states
        share = 1.0 / (self.delay or learners)
        acc = acc + (weight * share) * vector
        params = params + (-self.lr * weight * share) * vector
        self.progress += share
        if self.progress >= 1.0 - _ROUND_TOLERANCE:
            buf = self.mu * buf + acc
            params = params + (-self.lr * self.mu) * buf
            acc = np.zeros_like(acc)
            self.folds += 1
            self.progress = max(0.0, self.progress - 1.0)
            if self.progress < _ROUND_TOLERANCE:
                self.progress = 0.0
        self.states = [params, buf, acc]

    def _nesterov(self, vector: Vector, weight: float, learners: int) -> None:
        params, buf = self.states
        g = vector * weight
        if learners == 1:
            buf = self.mu * buf + g
            params = params - self.lr * (g + self.mu * buf)
        else:
            c = NesterovShares.of(self.mu, learners)
            params = params + (-self.lr * c.grad) * g + (-self.lr * c.look_ahead) * buf
            buf = c.decay * buf + c.gain * g
        self.states = [params, buf]


def combos_of(
    replay: Replay, num_states: int
) -> tuple[tuple[tuple[float, ...], ...], tuple[Formed, ...]]:
    """The fewest weighted sums of the updates the state tensors need, and how each state
    tensor is formed. The optimizer's state tensors first, the params last: a round with one
    Delayed Nesterov fold gathers two sums (the shares before the fold, folded into the
    momentum, and after it, the round sum), the params' being a combination of those; one
    without a fold gathers one; a Nesterov momentum two (params and momentum)."""
    combos: list[list[float]] = []
    sums: dict[int, list[float]] = {}
    order = [*range(1, len(replay.states)), 0]
    for index in order:
        row = [float(x) for x in replay.states[index][num_states:]]
        coefficients = _in_span(combos, row)
        if coefficients is None:
            combos.append(row)
            coefficients = [0.0] * (len(combos) - 1) + [1.0]
        sums[index] = coefficients
    formed = tuple(
        Formed(
            tuple(float(x) for x in state[:num_states]),
            tuple(sums[i] + [0.0] * (len(combos) - len(sums[i]))),
        )
        for i, state in enumerate(replay.states)
    )
    return tuple(tuple(c) for c in combos), formed


def _in_span(combos: list[list[float]], row: list[float]) -> list[float] | None:
    """Coefficients that form `row` from `combos` (within rounding), or None. Solved from
    the normal equations with correctly rounded sums (every member forms alike)."""
    if not any(row):
        return [0.0] * len(combos)
    if not combos:
        return None
    k = len(combos)
    system = [
        [math.fsum(x * y for x, y in zip(combos[i], combos[j], strict=True)) for j in range(k)]
        + [math.fsum(x * y for x, y in zip(combos[i], row, strict=True))]
        for i in range(k)
    ]
    coefficients = _solve(system)
    if coefficients is None:
        return None
    largest = max(abs(x) for x in row)
    for n, target in enumerate(row):
        formed = math.fsum(a * combo[n] for a, combo in zip(coefficients, combos, strict=True))
        if abs(formed - target) > _SAME_COMBO * largest:
            return None
    return coefficients


def _solve(system: list[list[float]]) -> list[float] | None:
    """Gaussian elimination with partial pivoting of a small augmented system; None when
    singular."""
    rows = [r[:] for r in system]
    k = len(rows)
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(rows[r][col]))
        if rows[pivot][col] == 0:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(k):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [x - factor * y for x, y in zip(rows[r], rows[col], strict=True)]
    return [rows[i][k] / rows[i][i] for i in range(k)]


def form_state(
    formed: Formed, states: list[torch.Tensor], gathered: Sequence[torch.Tensor]
) -> torch.Tensor:
    """One state tensor at the round's end (a new tensor: the old ones are read after)."""
    out = torch.zeros_like(states[0])
    for coefficient, state in zip(formed.states, states, strict=True):
        if coefficient != 0:
            out.add_(state, alpha=coefficient)
    for coefficient, total in zip(formed.sums, gathered, strict=True):
        if coefficient != 0:
            out.add_(total, alpha=coefficient)
    return out


def load_outer(
    outer: OuterOptimizer, tensors: list[torch.Tensor], steps: int, progress: float
) -> None:
    """The outer optimizer at the round's end: its state tensors, steps and round share."""
    state: dict[str, object] = {"kind": outer.kind, "buf": tensors[0], "count": steps}
    if len(tensors) > 1:
        state |= {"acc": tensors[1], "progress": progress}
    outer.load_state_dict(state)
