"""A byte-level GPT-style decoder, deterministic to build from (config, seed)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from node.hf_model import HFModelConfig, build_hf_model
from node.portable_init import normal_portable_
from node.presets import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_INNER_LR,
    MODEL_NAMES,
    PRESETS,
    ModelConfig,
    auto_model,
    model_size,
)

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_INNER_LR",
    "GPT",
    "PRESETS",
    "ModelConfig",
    "auto_model",
    "build_model",
    "model_config",
    "normal_portable_",
]


def model_config(name: str, vocab_size: int = 256) -> ModelConfig:
    """The shapes of model `name`: a preset (tiny/small/base) or hf:ARCH-SIZE."""
    if name not in MODEL_NAMES:
        choices = ", ".join(MODEL_NAMES)
        raise ValueError(f"unknown model {name!r}; choose one of {choices}")
    p = PRESETS[model_size(name)]
    shape: dict[str, Any] = {
        "n_layer": p.n_layer,
        "n_head": p.n_head,
        "n_embd": p.n_embd,
        "block_size": p.block_size,
        "vocab_size": vocab_size,
        "dropout": p.dropout,
    }
    if name.startswith("hf:"):
        return HFModelConfig(arch=name[3:].rsplit("-", 1)[0], **shape)
    return ModelConfig(**shape)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied input/output embeddings
        if self.wte.weight.device.type != "meta":  # a meta model only counts parameters
            self.init_weights(generator)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 init: normal(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                normal_portable_(p, residual_std, generator)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif "ln_" in name:
                nn.init.ones_(p)
            else:
                normal_portable_(p, 0.02, generator)

    def num_params(self) -> int:
        # parameters() deduplicates the tied embedding, so it is counted once.
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        seq_len = idx.size(1)
        if seq_len > self.config.block_size:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's block_size "
                f"{self.config.block_size}."
            )
        pos = torch.arange(seq_len, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(config: ModelConfig, seed: int) -> nn.Module:
    """Build a model whose initial parameters depend only on (config, seed).

    The result is bit-identical on every machine and leaves the caller's global RNG state
    untouched. It lives on the CPU; move it to a device afterwards. Its forward maps
    (idx, targets) to (logits, loss), for the built-in GPT and hf: models alike.
    """
    if hasattr(config, "arch"):
        assert isinstance(config, HFModelConfig)
        return build_hf_model(config, seed)
    with torch.random.fork_rng(devices=[]):  # the layers' default init draws from it
        return GPT(config, generator=torch.Generator().manual_seed(seed))
