"""The models a run can name: their names, size presets, shapes and defaults (no model code).

`node.config` validates `--model` against these names without importing a model; `node.model`
and `node.hf_model` build the models they name.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

MODEL_SIZES = ("tiny", "small", "base")
HF_ARCHITECTURES = ("llama", "gpt2")
MODEL_NAMES = MODEL_SIZES + tuple(f"hf:{a}-{s}" for a in HF_ARCHITECTURES for s in MODEL_SIZES)


def model_size(name: str) -> str:
    """The size preset of a model name: hf:llama-tiny -> tiny, small -> small."""
    return name.rsplit("-", 1)[-1] if name.startswith("hf:") else name


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    n_layer: int
    """Number of transformer blocks."""
    n_head: int
    """Attention heads per block; must divide n_embd."""
    n_embd: int
    """Width of the residual stream."""
    block_size: int
    """Longest sequence (context length) the model accepts."""
    vocab_size: int = 256
    """Number of distinct tokens; 256 for raw bytes."""
    dropout: float = 0.0
    """Dropout probability on attention, MLP and embeddings (0 disables it)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}.")
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}).")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}.")

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(n_layer=2, n_head=4, n_embd=128, block_size=128),
    "small": ModelConfig(n_layer=6, n_head=6, n_embd=384, block_size=256),
    "base": ModelConfig(n_layer=18, n_head=12, n_embd=768, block_size=1024),
}
_INNER_LR = {"tiny": 3e-3, "small": 1e-3, "base": 4e-4}
_BATCH_SIZE = {"tiny": 16, "small": 16, "base": 8}
# Keyed by model name (tiny, hf:llama-tiny, ...): an hf: model takes its size's defaults.
DEFAULT_INNER_LR: dict[str, float] = {name: _INNER_LR[model_size(name)] for name in MODEL_NAMES}
DEFAULT_BATCH_SIZE: dict[str, int] = {name: _BATCH_SIZE[model_size(name)] for name in MODEL_NAMES}


def auto_model(device: str) -> str:
    """--model auto: tiny on a CPU, base on a GPU with >= 16 GiB, else small."""
    import torch  # here: the CLI's parser and settings load without torch

    if device == "cpu" or not torch.cuda.is_available():
        return "tiny"
    memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return "base" if memory >= 16 * 2**30 else "small"
