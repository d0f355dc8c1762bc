"""Outer optimizers: step the flat fp32 replica with one weighted pseudo-gradient at a time.

A pseudo-gradient is theta_base - theta_local, so it points uphill like a gradient and the
optimizers subtract it.

Sized to the swarm: each update carries M, its author's count of live learners (signed in its
header), and counts as 1/M of a round. One round of M equal updates moves the params exactly
like one synchronous DiLoCo outer step (Nesterov, lr, momentum) on their mean, for any M:
- delayed_nesterov (Liu et al. 2024): a plain step lr*w*g/M on every update; the momentum is
  folded in once per round, when the updates' 1/M shares add up to one;
- nesterov: momentum on every update, with the per-update decay, gradient and look-ahead
  coefficients chosen so that the momentum decays by `momentum` per round, not per update.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

import torch

OuterKind = Literal["nesterov", "delayed_nesterov"]


@dataclass(frozen=True, kw_only=True)
class OuterConfig:
    """The outer optimizer that applies merged pseudo-gradients to the replica."""

    kind: OuterKind = "delayed_nesterov"
    """nesterov: SGD with Nesterov momentum on every update (DiLoCo); delayed_nesterov: plain
    steps on every update with the momentum folded in every `delay`-th (Liu et al. 2024)."""
    lr: float = 0.7
    """Outer learning rate."""
    momentum: float = 0.9
    """Nesterov momentum coefficient, in [0, 1)."""
    delay: int | None = None
    """delayed_nesterov only: a fixed round of N updates (each scaled 1/N) instead of the
    learner count in each update's header; None follows the swarm."""

    def __post_init__(self) -> None:
        if self.kind not in get_args(OuterKind):
            raise ValueError(f"outer optimizer kind must be one of {get_args(OuterKind)}.")
        if not isinstance(self.lr, int | float) or not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"outer lr must be a finite number > 0, got {self.lr!r}.")
        if not isinstance(self.momentum, int | float) or not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum!r}.")
        if self.delay is not None and (type(self.delay) is not int or self.delay < 1):
            raise ValueError(f"outer delay must be None or an integer >= 1, got {self.delay!r}.")


_ROUND_TOLERANCE = 1e-9
"""Round progress this close to a whole round counts as complete (float sums of 1/M)."""


class OuterOptimizer(ABC):
    """Owns the outer optimizer state for a flat parameter vector of ``numel`` elements."""

    kind: str

    def __init__(self, *, lr: float, momentum: float, numel: int) -> None:
        self.lr = lr
        self.momentum = momentum
        self.numel = numel
        self._buf = torch.zeros(numel, dtype=torch.float32)
        self._count = 0

    @abstractmethod
    def step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> float | None:
        """Applies ``weight * pseudo_gradient`` as 1/``learners`` of a round, in place.

        Returns |a| when the step moved ``params`` by a * ``pseudo_gradient`` and nothing else
        (so by at most |a| times its norm: what lets the replica bound its params norm without
        a pass over them), or None when it moved them otherwise too (a momentum term).
        """

    def plain_step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> float:
        """A flush (merge.envelope's flush marker): params -= lr * weight * g / learners and
        nothing else: no momentum built, none applied, no share of a round. Returns |a|.

        A translation that reads and writes no optimizer state, so it commutes with every
        other step: replicas that applied one set of updates agree whatever the order. It moves
        the params by the plain share any update moves them by at once, and never more than
        a regular update's whole effect (that share plus what momentum builds on it), under
        the same weight and learners, which the pipeline bounds for every update alike."""
        self._check_step(params, pseudo_gradient, weight, learners)
        moved = -self.lr * weight / learners
        params.add_(pseudo_gradient, alpha=moved)
        return abs(moved)

    def withdraw_plain(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> None:
        """Takes back a :meth:`plain_step` exactly (merge.equivocation)."""
        self._check_step(params, pseudo_gradient, weight, learners)
        params.add_(pseudo_gradient, alpha=self.lr * weight / learners)

    @property
    def momentum_buffer(self) -> torch.Tensor:
        """The outer momentum (a view: read it under the replica's lock, never write it)."""
        return self._buf

    def momentum_direction(self) -> torch.Tensor | None:
        """The direction the replica has been moving in (the momentum); None before a step."""
        return self._buf if self._count else None

    def momentum_parts(self) -> list[torch.Tensor]:
        """Views that sum to :meth:`momentum_direction` (none before a step), without adding
        them up: the merge path takes dot products with each (read them under the lock)."""
        return [self._buf] if self._count else []

    def state_tensors(self) -> list[torch.Tensor]:
        """Views of the state a step reads and writes besides the params: the momentum (and a
        delayed optimizer's round not folded yet). Read them under the replica's lock."""
        return [self._buf]

    def round_state(self) -> tuple[int, float]:
        """(steps taken, share of the current round done): what, with :meth:`state_tensors`,
        decides the next steps (merge.shard_round replays them on coefficients)."""
        return self._count, 0.0

    def rest_terms(
        self, state: Mapping[str, object] | None = None
    ) -> list[tuple[float, torch.Tensor]]:
        """(coefficient, buffer) pairs: as the momentum plays out with no further update, the
        params still move by the sum of coefficient * buffer (of ``state``, a state_dict of
        this kind, when given; views of this optimizer's own buffers otherwise).

        Each update's total effect on the params once it has played out depends on its own
        weight and learners alone, not on the order the updates came in; so the params plus
        this rest are the same on every replica that applied the same updates (up to rounding),
        where the params themselves differ by the momentum tail. Nesterov: the momentum b
        still adds lr * mu^2 * b * (1 + mu + ...) = lr * mu^2 / (1 - mu) * b.
        """
        if state is None:
            buf = self._buf
        else:
            self._check_kind(state)
            buf = _state_tensor(state, "buf", self.numel)
        return [(self._rest(self.momentum * self.momentum), buf)]

    def _rest(self, first: float) -> float:
        """-lr * (first + first * mu + first * mu^2 + ...): a buffer's remaining pull."""
        return -self.lr * first / (1.0 - self.momentum)

    def state_dict(self) -> dict[str, object]:
        """Tensors (copies), ints, floats and strs only: loadable with weights_only=True."""
        return {"kind": self.kind, "buf": self._buf.clone(), "count": self._count}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self._check_kind(state)
        buf, count = _state_tensor(state, "buf", self.numel), _state_count(state)
        self._buf.copy_(buf)
        self._count = count

    def _check_kind(self, state: Mapping[str, object]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"outer state is for {state.get('kind')!r}, not {self.kind!r}.")

    def _weighted(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int
    ) -> torch.Tensor:
        self._check_step(params, pseudo_gradient, weight, learners)
        return pseudo_gradient * weight

    def withdraw(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> None:
        """Takes back the plain share ``lr * weight * g / learners`` that :meth:`step` moved the
        params by (merge.equivocation); what momentum built on it decays like any tail."""
        self._check_step(params, pseudo_gradient, weight, learners)
        params.add_(pseudo_gradient, alpha=self.lr * weight / learners)

    def take_back(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> None:
        """Takes back every term of :meth:`step` that is linear in ``g`` (the plain share, and
        what ``g`` added to an optimizer state), leaving its slot: the momentum's decay and
        look-ahead, the round's progress. A superseded group variant's step is taken back so,
        for :meth:`put_in` to step the prevailing one in its slot (merge.equivocation). The
        step no longer counts as taken: a momentum it alone made is none again, as on a
        replica that never applied it (the robust judge checks no cosine against none)."""
        self.withdraw(params, pseudo_gradient, weight, learners)
        self._count = max(0, self._count - 1)

    def put_in(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> None:
        """Adds every term of :meth:`step` linear in ``g`` into the slot :meth:`take_back`
        left: with it, the update stepped as if it had been applied there in the first place."""
        self._check_step(params, pseudo_gradient, weight, learners)
        params.add_(pseudo_gradient, alpha=-self.lr * weight / learners)
        self._count += 1

    def _check_step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int
    ) -> None:
        _check_flat("params", params, self.numel)
        _check_flat("pseudo_gradient", pseudo_gradient, self.numel)
        if not isinstance(weight, int | float) or not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"update weight must be a finite number >= 0, got {weight!r}.")
        if type(learners) is not int or learners < 1:
            raise ValueError(f"learners must be an integer >= 1, got {learners!r}.")


@dataclass(frozen=True)
class NesterovShares:
    """Per-update coefficients of Nesterov momentum spread evenly over a round of M updates.

    With b the momentum before an update g: params -= lr * (grad * g + look_ahead * b), then
    b = decay * b + gain * g. After M equal updates g from momentum b0 this is exactly one
    Nesterov step on g: b = momentum * b0 + g, params moved by -lr * (g + momentum * b).
    """

    decay: float
    gain: float
    grad: float
    look_ahead: float

    @classmethod
    def of(cls, momentum: float, learners: int) -> NesterovShares:
        m, mu = float(learners), momentum
        decay = mu ** (1.0 / m)  # momentum decays by mu per round
        gain = (1.0 - decay) / (1.0 - mu)  # the M gains sum (geometrically) to one g
        look_ahead = mu * mu * gain  # sum over the round of look_ahead * b = mu^2 * b0
        # sum over the round of the g terms that build up inside b, per unit of g:
        built_up = (m - (1.0 - mu) / (1.0 - decay)) / (1.0 - decay) if decay > 0 else 0.0
        grad = (1.0 + mu - look_ahead * gain * built_up) / m
        return cls(decay=decay, gain=gain, grad=grad, look_ahead=look_ahead)


class NesterovSGD(OuterOptimizer):
    """Nesterov momentum on every update, sized so a round of M updates is one Nesterov step.

    With one learner (M = 1) it is torch.optim.SGD(nesterov=True), with the same arithmetic.
    """

    kind = "nesterov"

    def step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> float | None:
        g = self._weighted(params, pseudo_gradient, weight, learners)
        if learners == 1:
            self._buf.mul_(self.momentum).add_(g)
            params.add_(g.add_(self._buf, alpha=self.momentum), alpha=-self.lr)
        else:
            c = NesterovShares.of(self.momentum, learners)
            params.add_(g, alpha=-self.lr * c.grad).add_(self._buf, alpha=-self.lr * c.look_ahead)
            self._buf.mul_(c.decay).add_(g, alpha=c.gain)
        self._count += 1
        return None  # the params moved along the momentum too

    def withdraw(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> None:
        """Takes back what :meth:`step` added for ``g``: its gradient share of the params and
        its gain in the momentum (the look-ahead on the earlier momentum stays)."""
        self._check_step(params, pseudo_gradient, weight, learners)
        c = NesterovShares.of(self.momentum, learners)
        params.add_(pseudo_gradient, alpha=self.lr * weight * c.grad)
        self._buf.add_(pseudo_gradient, alpha=-weight * c.gain)

    def take_back(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> None:
        """As :meth:`withdraw`, the momentum's gain subtracted as the rounded product the
        step's fused add produced: a momentum that was zero before the step is zero again
        (a remainder of float rounding would give the next update a random cosine)."""
        self._check_step(params, pseudo_gradient, weight, learners)
        c = NesterovShares.of(self.momentum, learners)
        params.add_(pseudo_gradient, alpha=self.lr * weight * c.grad)
        self._buf.sub_((pseudo_gradient * weight).mul_(c.gain))
        self._count = max(0, self._count - 1)

    def put_in(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> None:
        self._check_step(params, pseudo_gradient, weight, learners)
        c = NesterovShares.of(self.momentum, learners)
        params.add_(pseudo_gradient, alpha=-self.lr * weight * c.grad)
        self._buf.add_(pseudo_gradient, alpha=weight * c.gain)
        self._count += 1


class DelayedNesterov(OuterOptimizer):
    """Plain steps lr*g/M on every update; once per round of M updates, the momentum on them.

    A round completes when the 1/M shares of the updates since the last one add up to one
    (M from each update's header, or the fixed ``delay``). With M = 1 it is Nesterov SGD.
    """

    kind = "delayed_nesterov"

    def __init__(self, *, lr: float, momentum: float, numel: int, delay: int | None = None) -> None:
        super().__init__(lr=lr, momentum=momentum, numel=numel)
        self.delay = delay
        self._acc = torch.zeros(numel, dtype=torch.float32)
        self._progress = 0.0
        self._direction: torch.Tensor | None = None

    def step(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> float | None:
        self._check_step(params, pseudo_gradient, weight, learners)
        share = 1.0 / (self.delay or learners)
        # Scaled on the fly: no temporary the size of the model (the merge path's cost).
        self._acc.add_(pseudo_gradient, alpha=weight * share)
        moved = -self.lr * weight * share
        params.add_(pseudo_gradient, alpha=moved)
        self._count += 1
        self._progress += share
        if self._progress >= 1.0 - _ROUND_TOLERANCE:
            self._buf.mul_(self.momentum).add_(self._acc)
            params.add_(self._buf, alpha=-self.lr * self.momentum)
            self._acc.zero_()
            self._progress = max(0.0, self._progress - 1.0)
            if self._progress < _ROUND_TOLERANCE:
                self._progress = 0.0
            return None  # the fold moved the params along the momentum too
        return abs(moved)

    def withdraw(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> None:
        """Takes back the plain step; its share of the round's sum goes into the momentum
        when the round folds (or went already) and decays from there, and the round's progress
        stays (the other updates of the round complete it)."""
        self._check_step(params, pseudo_gradient, weight, learners)
        params.add_(pseudo_gradient, alpha=self.lr * weight / (self.delay or learners))

    def take_back(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> None:
        """The plain step and its share of the round's sum (folded already or not: the sum's
        share then goes into the next fold negated, and the settled point loses it all)."""
        self.withdraw(params, pseudo_gradient, weight, learners)
        self._acc.sub_(pseudo_gradient * (weight / (self.delay or learners)))  # as Nesterov's
        self._count = max(0, self._count - 1)

    def put_in(
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float, learners: int = 1
    ) -> None:
        """The plain step and the share of the round's sum; the round's progress stays (the
        slot's share counted when the id was first applied)."""
        self._check_step(params, pseudo_gradient, weight, learners)
        share = 1.0 / (self.delay or learners)
        self._acc.add_(pseudo_gradient, alpha=weight * share)
        params.add_(pseudo_gradient, alpha=-self.lr * weight * share)
        self._count += 1

    def momentum_direction(self) -> torch.Tensor | None:
        """The momentum plus the updates not yet folded into it (_acc holds scaled shares).

        A buffer reused by the next call: read it under the replica's lock, never write it.
        (Allocating a model-sized tensor per merged update costs more than the sum itself.)
        """
        if not self._count:
            return None
        if self._progress == 0.0:
            return self._buf
        if self._direction is None:
            self._direction = torch.empty_like(self._buf)
        return torch.add(self._buf, self._acc, out=self._direction)

    def momentum_parts(self) -> list[torch.Tensor]:
        if not self._count:
            return []
        return [self._buf] if self._progress == 0.0 else [self._buf, self._acc]

    def state_tensors(self) -> list[torch.Tensor]:
        return [self._buf, self._acc]

    def round_state(self) -> tuple[int, float]:
        return self._count, self._progress

    def rest_terms(
        self, state: Mapping[str, object] | None = None
    ) -> list[tuple[float, torch.Tensor]]:
        """The momentum as Nesterov's, plus the round not folded yet: the next fold adds it
        to the momentum, which then pulls the params by lr * mu / (1 - mu) of it."""
        acc = self._acc if state is None else _state_tensor(state, "acc", self.numel)
        return [*super().rest_terms(state), (self._rest(self.momentum), acc)]

    def state_dict(self) -> dict[str, object]:
        return {**super().state_dict(), "acc": self._acc.clone(), "progress": self._progress}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self._check_kind(state)
        acc = _state_tensor(state, "acc", self.numel)
        progress = state.get("progress", 0.0)  # checkpoints before swarm sizing lack it
        if type(progress) is not float or not 0.0 <= progress < 1.0:
            raise ValueError(f"outer state 'progress' must be a float in [0, 1), got {progress!r}.")
        super().load_state_dict(state)
        self._acc.copy_(acc)
        self._progress = progress


def make_outer_optimizer(config: OuterConfig, numel: int) -> OuterOptimizer:
    if type(numel) is not int or numel < 0:
        raise ValueError(f"numel must be a non-negative integer, got {numel!r}.")
    if config.kind == "nesterov":
        return NesterovSGD(lr=config.lr, momentum=config.momentum, numel=numel)
    return DelayedNesterov(lr=config.lr, momentum=config.momentum, delay=config.delay, numel=numel)


def _check_flat(name: str, tensor: torch.Tensor, numel: int) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.shape != (numel,):
        raise ValueError(f"{name} must be a 1-D tensor of {numel} elements.")
    if tensor.dtype != torch.float32 or tensor.device.type != "cpu":
        raise ValueError(
            f"{name} must be an fp32 CPU tensor, got {tensor.dtype} on {tensor.device}."
        )


def _state_tensor(state: Mapping[str, object], key: str, numel: int) -> torch.Tensor:
    tensor = state.get(key)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"outer state lacks the tensor {key!r}.")
    _check_flat(f"outer state {key!r}", tensor, numel)
    return tensor


def _state_count(state: Mapping[str, object]) -> int:
    count = state.get("count")
    if type(count) is not int or count < 0:
        raise ValueError(f"outer state 'count' must be an integer >= 0, got {count!r}.")
    return count
