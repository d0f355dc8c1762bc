"""Outer optimizers: step the flat fp32 replica with one weighted pseudo-gradient at a time.

A pseudo-gradient is theta_base - theta_local, so it points uphill like a gradient and the
optimizers subtract it.
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
    delay: int = 4
    """Updates between momentum steps of delayed_nesterov (N); 1 makes it plain Nesterov."""

    def __post_init__(self) -> None:
        if self.kind not in get_args(OuterKind):
            raise ValueError(f"outer optimizer kind must be one of {get_args(OuterKind)}.")
        if not isinstance(self.lr, int | float) or not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"outer lr must be a finite number > 0, got {self.lr!r}.")
        if not isinstance(self.momentum, int | float) or not 0 <= self.momentum < 1:
            raise ValueError(f"outer momentum must be in [0, 1), got {self.momentum!r}.")
        if type(self.delay) is not int or self.delay < 1:
            raise ValueError(f"outer delay must be an integer >= 1, got {self.delay!r}.")


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
    def step(self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float) -> None:
        """Applies ``weight * pseudo_gradient`` to ``params`` in place."""

    def state_dict(self) -> dict[str, object]:
        """Tensors (copies), ints and strs only: loadable with torch.load(weights_only=True)."""
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
        self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float
    ) -> torch.Tensor:
        _check_flat("params", params, self.numel)
        _check_flat("pseudo_gradient", pseudo_gradient, self.numel)
        if not isinstance(weight, int | float) or not (math.isfinite(weight) and weight >= 0):
            raise ValueError(f"update weight must be a finite number >= 0, got {weight!r}.")
        return pseudo_gradient * weight


class NesterovSGD(OuterOptimizer):
    """torch.optim.SGD(nesterov=True) on the weighted pseudo-gradient, with the same arithmetic."""

    kind = "nesterov"

    def step(self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float) -> None:
        g = self._weighted(params, pseudo_gradient, weight)
        if self._count == 0:
            self._buf.copy_(g)
        else:
            self._buf.mul_(self.momentum).add_(g)
        params.add_(g.add_(self._buf, alpha=self.momentum), alpha=-self.lr)
        self._count += 1


class DelayedNesterov(OuterOptimizer):
    """Plain steps lr*g/N on every update; every N-th update, momentum over their mean.

    With N = 1 it is Nesterov SGD.
    """

    kind = "delayed_nesterov"

    def __init__(self, *, lr: float, momentum: float, delay: int, numel: int) -> None:
        super().__init__(lr=lr, momentum=momentum, numel=numel)
        self.delay = delay
        self._acc = torch.zeros(numel, dtype=torch.float32)

    def step(self, params: torch.Tensor, pseudo_gradient: torch.Tensor, weight: float) -> None:
        g = self._weighted(params, pseudo_gradient, weight)
        self._acc.add_(g)
        params.add_(g, alpha=-self.lr / self.delay)
        self._count += 1
        if self._count % self.delay == 0:
            self._buf.mul_(self.momentum).add_(self._acc, alpha=1.0 / self.delay)
            params.add_(self._buf, alpha=-self.lr * self.momentum)
            self._acc.zero_()

    def state_dict(self) -> dict[str, object]:
        return {**super().state_dict(), "acc": self._acc.clone()}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self._check_kind(state)
        acc = _state_tensor(state, "acc", self.numel)
        super().load_state_dict(state)
        self._acc.copy_(acc)


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
