"""The inner loop: H AdamW steps on this node's shard, starting from a copy of the replica."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from node.data import ShardSampler
from node.inner_optim import InnerAdamW


@dataclass(frozen=True, kw_only=True)
class InnerConfig:
    lr: float
    """Peak learning rate."""
    weight_decay: float
    """AdamW weight decay."""
    grad_clip: float
    """Gradient norm clip; 0 disables."""
    warmup_steps: int
    """Linear warmup length in steps."""
    decay_steps: int
    """Cosine decay horizon in steps; the rate floors at 10% of peak after it."""
    speed_factor: float = 1.0
    """Emulated slower hardware: after each inner step, sleep F-1 times its measured duration,
    so the learner runs F times slower (1: full speed)."""
    emulated_step_s: float | None = None
    """With it, the emulation paces instead: each inner step lasts speed_factor times this
    many seconds (the rest slept), whatever the machine's load (benchmarks)."""

    def __post_init__(self) -> None:
        f = self.speed_factor
        if not isinstance(f, int | float) or not (math.isfinite(f) and 1.0 <= f <= 1000.0):
            raise ValueError(f"speed factor must be a number in [1, 1000], got {f!r}.")
        pace = self.emulated_step_s
        if pace is not None and not (math.isfinite(pace) and pace > 0):
            raise ValueError(f"emulated step time must be a positive number, got {pace!r}.")


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float
    tokens_per_s: float
    tokens: int = 0
    """Tokens of the step's batch."""
    seconds: float = 0.0
    """The step's wall time (emulated slow-down included)."""


@dataclass(frozen=True)
class RoundStats:
    num_steps: int
    """Inner steps completed (fewer than asked when stopped early)."""
    tokens: int
    loss: float
    """Mean training loss over the round."""
    compute_s: float
    """Wall time spent inside inner steps (emulated slow-down included)."""
    stopped_early: bool = False
    """The round was interrupted by should_stop (a partial round; not to be published)."""
    emulated_s: float = 0.0
    """Of compute_s, the sleep that emulates slower hardware (--speed-factor)."""


def inner_lr(config: InnerConfig, step: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak rate."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.decay_steps))
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _next_step_overruns(max_seconds: float | None, spent_s: float, steps: int) -> bool:
    """Whether one more step of the round's mean duration would end past ``max_seconds``."""
    return max_seconds is not None and steps > 0 and spent_s + spent_s / steps > max_seconds


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


class Learner:
    """Owns the model, the inner optimizer and the data stream of this node."""

    def __init__(
        self, model: nn.Module, sampler: ShardSampler, config: InnerConfig, device: torch.device
    ) -> None:
        self.model = model.to(device)
        self.sampler = sampler
        self.config = config
        self.device = device
        self.step = 0
        self.optimizer = self._build_optimizer()

    def _build_optimizer(self) -> InnerAdamW | torch.optim.Optimizer:
        """AdamW, not torch.optim.AdamW: its first call imports torch._dynamo, ~as long as
        `import torch`, on every start's path to the first inner step (node.inner_optim)."""
        return InnerAdamW(
            self.model.parameters(),
            lr=self.config.lr,
            weight_decay=self.config.weight_decay,
            betas=(0.9, 0.95),
            fused=self.device.type == "cuda",
        )

    def load_params(self, flat: torch.Tensor) -> None:
        """Copy `flat` into the model in place (vector_to_parameters would alias it instead)."""
        offset = 0
        with torch.no_grad():
            for param in self.model.parameters():
                chunk = flat[offset : offset + param.numel()]
                param.copy_(chunk.view_as(param), non_blocking=True)
                offset += param.numel()

    def params_vector(self) -> torch.Tensor:
        with torch.no_grad():
            return parameters_to_vector(self.model.parameters()).detach().float().cpu()

    def run_round(
        self,
        num_steps: int,
        should_stop: Callable[[], bool],
        on_step: Callable[[StepStats], None],
        max_seconds: float | None = None,
    ) -> RoundStats:
        """Up to ``num_steps`` inner steps; with ``max_seconds``, as many as fit in that time.

        Dynamic local updates: a round with a time limit stops before a step that would end
        past it (judged by the round's mean step time so far), after at least one step.
        """
        self.model.train()
        losses: list[float] = []
        tokens = 0
        compute_s = emulated_s = 0.0
        stopped_early = False
        for _ in range(num_steps):
            if should_stop():
                stopped_early = True
                break
            if _next_step_overruns(max_seconds, compute_s, len(losses)):
                break
            start = time.perf_counter()
            loss, batch_tokens = self._inner_step()
            emulated_s += self._emulate_slower_hardware(time.perf_counter() - start)
            elapsed = time.perf_counter() - start
            compute_s += elapsed
            tokens += batch_tokens
            losses.append(loss)
            rate = batch_tokens / max(elapsed, 1e-9)
            on_step(StepStats(len(losses), loss, rate, batch_tokens, elapsed))
        mean_loss = sum(losses) / len(losses) if losses else float("nan")
        return RoundStats(
            num_steps=len(losses),
            tokens=tokens,
            loss=mean_loss,
            compute_s=compute_s,
            stopped_early=stopped_early,
            emulated_s=emulated_s,
        )

    def _emulate_slower_hardware(self, step_s: float) -> float:
        """Sleeps F-1 times the step's duration (or up to F x the paced step time); returns
        the seconds slept."""
        factor, pace = self.config.speed_factor, self.config.emulated_step_s
        delay = (factor - 1.0) * step_s if pace is None else factor * pace - step_s
        if delay <= 0:
            return 0.0
        start = time.perf_counter()
        time.sleep(delay)
        return time.perf_counter() - start

    def _inner_step(self) -> tuple[float, int]:
        x, y = self.sampler.next_batch()
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        for group in self.optimizer.param_groups:
            group["lr"] = inner_lr(self.config, self.step)
        with self._autocast():
            _, loss = self.model(x, y)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        self.optimizer.step()
        self.step += 1
        return float(loss.item()), x.numel()

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Mean loss of the current parameters on fixed validation batches."""
        return validation_loss(self.model, batches, self.device)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        return autocast(self.device)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "sampler": self.sampler.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def validation_loss(
    model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> float:
    """Mean loss of `model` on fixed validation batches (left in eval mode)."""
    model.eval()
    total = 0.0
    with torch.no_grad():
        for x, y in batches:
            with autocast(device):
                _, loss = model(x.to(device), y.to(device))
            total += float(loss.item())
    return total / len(batches)
