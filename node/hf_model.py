"""Real architectures from `transformers` (Llama, GPT-2), randomly initialised, nothing downloaded.

`--model hf:ARCH-SIZE` (for example hf:llama-tiny, hf:gpt2-base) builds the architecture ARCH
with the shapes of the built-in SIZE preset and a byte vocabulary. The weights are drawn here,
not by transformers, from the run's genesis seed in float64 on the CPU, so every replica starts
bit-identical on any machine; the optional extra `pip install -e ".[hf]"` provides transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from node.portable_init import normal_portable_
from node.presets import HF_ARCHITECTURES, ModelConfig

# Output projections of a residual branch: drawn with std 0.02 / sqrt(2 * n_layer), as GPT-2.
_RESIDUAL_PROJECTIONS = ("c_proj.weight", "o_proj.weight", "down_proj.weight")


@dataclass(frozen=True, kw_only=True)
class HFModelConfig(ModelConfig):
    arch: str
    """transformers architecture: llama or gpt2."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.arch not in HF_ARCHITECTURES:
            choices = ", ".join(HF_ARCHITECTURES)
            raise ValueError(f"unknown architecture {self.arch!r}; choose one of {choices}")

    def to_transformers(self) -> Any:
        """The transformers config (LlamaConfig or GPT2Config) of this model."""
        transformers = require_transformers()
        if self.arch == "llama":
            return transformers.LlamaConfig(
                vocab_size=self.vocab_size,
                hidden_size=self.n_embd,
                intermediate_size=swiglu_width(self.n_embd),
                num_hidden_layers=self.n_layer,
                num_attention_heads=self.n_head,
                num_key_value_heads=self.n_head,
                max_position_embeddings=self.block_size,
                attention_dropout=self.dropout,
                tie_word_embeddings=False,
                use_cache=False,
                attn_implementation="sdpa",
            )
        return transformers.GPT2Config(
            vocab_size=self.vocab_size,
            n_embd=self.n_embd,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_positions=self.block_size,
            bos_token_id=None,
            eos_token_id=None,
            resid_pdrop=self.dropout,
            embd_pdrop=self.dropout,
            attn_pdrop=self.dropout,
            use_cache=False,
            attn_implementation="sdpa",
        )


def swiglu_width(n_embd: int) -> int:
    """Llama's MLP width: 8/3 of the model width (same parameters as a 4x GELU MLP), x64."""
    return 64 * math.ceil(8 * n_embd / 3 / 64)


def require_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ValueError(
            'hf: models need transformers; install the extra: pip install -e ".[hf]"'
        ) from None
    return transformers


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the built-in model's interface: (logits, loss)."""

    def __init__(self, config: HFModelConfig) -> None:
        super().__init__()
        transformers = require_transformers()
        self.config = config
        self.hf = transformers.AutoModelForCausalLM.from_config(config.to_transformers())

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if idx.size(1) > self.config.block_size:
            raise ValueError(
                f"sequence length {idx.size(1)} exceeds the model's block_size "
                f"{self.config.block_size}."
            )
        logits = self.hf(input_ids=idx, use_cache=False).logits
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Matrices ~ N(0, 0.02) (residual projections scaled down), biases 0, norm gains 1."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim == 1:
                nn.init.ones_(p)
            elif name.endswith(_RESIDUAL_PROJECTIONS):
                normal_portable_(p, residual_std, generator)
            else:
                normal_portable_(p, 0.02, generator)


def build_hf_model(config: HFModelConfig, seed: int) -> HFCausalLM:
    """An HF causal LM whose parameters depend only on (config, seed), on the CPU."""
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from it
        model = HFCausalLM(config)
    model.init_weights(torch.Generator().manual_seed(seed))
    return model
