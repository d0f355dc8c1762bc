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


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float
    tokens_per_s: float


@dataclass(frozen=True)
class RoundStats:
    num_steps: int
    """Inner steps completed (fewer than asked when stopped early)."""
    tokens: int
    loss: float
    """Mean training loss over the round."""
    compute_s: float
    """Wall time spent inside inner steps."""


def inner_lr(config: InnerConfig, step: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak rate."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.decay_steps))
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


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
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=config.lr,
            weight_decay=config.weight_decay,
            betas=(0.9, 0.95),
            fused=device.type == "cuda",
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
    ) -> RoundStats:
        self.model.train()
        losses: list[float] = []
        tokens = 0
        compute_s = 0.0
        for _ in range(num_steps):
            if should_stop():
                break
            start = time.perf_counter()
            loss, batch_tokens = self._inner_step()
            elapsed = time.perf_counter() - start
            compute_s += elapsed
            tokens += batch_tokens
            losses.append(loss)
            on_step(StepStats(len(losses), loss, batch_tokens / max(elapsed, 1e-9)))
        mean_loss = sum(losses) / len(losses) if losses else float("nan")
        return RoundStats(num_steps=len(losses), tokens=tokens, loss=mean_loss, compute_s=compute_s)

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
        self.model.eval()
        total = 0.0
        for x, y in batches:
            with self._autocast():
                _, loss = self.model(x.to(self.device), y.to(self.device))
            total += float(loss.item())
        return total / len(batches)

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

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
