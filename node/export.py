"""`diloco-node export`: a checkpoint's replica as a standard model that loads anywhere.

The output is a Hugging Face model directory, config.json + model.safetensors, which
`transformers.AutoModelForCausalLM.from_pretrained(DIR)` loads without this package:
- hf: models are saved by transformers itself (save_pretrained);
- the built-in GPT is GPT-2 (pre-norm blocks, learned positions, exact GELU, tied
  embeddings), so it is written under GPT-2's parameter names, and also loads with plain
  torch + safetensors (docs/export.md has a 20-line forward pass).
diloco.json next to them records where the weights came from (run, round, merged updates).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from node.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    checkpoint_round,
    node_checkpoints,
    read_checkpoint,
)
from node.hf_model import HFCausalLM
from node.model import GPT, ModelConfig, build_model, model_config

_GPT2_NAMES = (
    ("blocks.", "h."),
    ("attn.qkv.", "attn.c_attn."),
    ("attn.proj.", "attn.c_proj."),
    ("mlp.fc.", "mlp.c_fc."),
    ("mlp.proj.", "mlp.c_proj."),
)
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
PROVENANCE_FILE = "diloco.json"


@dataclass(frozen=True)
class ExportResult:
    out: Path
    model: str
    num_params: int
    round: int
    num_applied: int
    """Updates merged into the replica: 0 is the untrained initial model."""


def checkpoint_model(state: dict[str, Any]) -> tuple[str, int] | None:
    """(model name, vocab size) recorded in a checkpoint, None for one that predates them."""
    model = state.get("model")
    if not isinstance(model, dict):
        return None
    name, vocab = model.get("name"), model.get("vocab_size")
    if not isinstance(name, str) or type(vocab) is not int:
        raise CheckpointError("the checkpoint's model description is damaged")
    return name, vocab


def export_checkpoint(checkpoint_dir: Path, out: Path, model: str | None = None) -> ExportResult:
    """Write the replica of the checkpoint in `checkpoint_dir` to `out` as an HF model."""
    _check_one_node(checkpoint_dir)
    state = read_checkpoint(checkpoint_dir)
    if state is None:
        raise ValueError(
            f"no checkpoint in {checkpoint_dir}; a node keeps its own in "
            "~/.diloco/checkpoints/RUN_ID/PEER_ID unless it ran with --checkpoint-dir"
        )
    name, config = _resolve_model(state, model)
    params = _replica_params(state)
    module = build_model(config, seed=0)
    expected = sum(p.numel() for p in module.parameters())
    if params.numel() != expected:
        raise ValueError(
            f"the checkpoint holds {params.numel()} parameters but {name} has {expected}; "
            "pass the --model the run trained"
        )
    load_flat_(module, params)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(module, GPT):
        save_gpt_as_gpt2(module, out)
    else:
        assert isinstance(module, HFCausalLM)
        module.hf.save_pretrained(out)
    provenance = {
        "model": name,
        "fingerprint": state.get("fingerprint"),
        "round": state.get("round"),
        "num_applied": state.get("replica", {}).get("num_applied"),
    }
    (out / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
    return ExportResult(
        out=out,
        model=name,
        num_params=expected,
        round=int(state.get("round", 0)),
        num_applied=int(provenance["num_applied"] or 0),
    )


def _check_one_node(run_dir: Path) -> None:
    """A run's directory (RUN_ID/, the default layout) with several nodes' checkpoints:
    which one to export is the user's choice, so name them all with their rounds."""
    if (run_dir / MANIFEST_FILE).exists() or not run_dir.is_dir():
        return
    nodes = node_checkpoints(run_dir)
    if len(nodes) > 1:
        listed = ", ".join(f"{path} ({_round_label(path)})" for path in nodes)
        raise ValueError(
            f"{run_dir} holds the checkpoints of {len(nodes)} nodes; "
            f"pass one of them as --checkpoint-dir: {listed}"
        )


def _round_label(node_dir: Path) -> str:
    round_done = checkpoint_round(node_dir)
    return "round unknown" if round_done is None else f"{round_done} rounds done"


def _resolve_model(state: dict[str, Any], asked: str | None) -> tuple[str, ModelConfig]:
    recorded = checkpoint_model(state)
    if recorded is None and asked is None:
        raise ValueError("this checkpoint does not record its model; pass --model")
    if recorded is not None and asked is not None and asked != recorded[0]:
        raise ValueError(f"the checkpoint holds model {recorded[0]}, not {asked}")
    name, vocab_size = recorded or (str(asked), 256)
    return name, model_config(name, vocab_size)


def _replica_params(state: dict[str, Any]) -> Tensor:
    replica = state.get("replica")
    params = replica.get("params") if isinstance(replica, dict) else None
    if not isinstance(params, Tensor) or params.ndim != 1 or not params.is_floating_point():
        raise CheckpointError("the checkpoint holds no replica parameters")
    return params.float()


@torch.no_grad()
def load_flat_(model: nn.Module, flat: Tensor) -> None:
    """Copy a flat parameter vector (the replica's layout: model.parameters() order) in place."""
    offset = 0
    for param in model.parameters():
        param.copy_(flat[offset : offset + param.numel()].view_as(param))
        offset += param.numel()


def gpt2_state_dict(gpt: GPT) -> dict[str, Tensor]:
    """The built-in GPT's weights under GPT-2's names (GPT-2 stores linear maps as in x out)."""
    state = {}
    for name, tensor in gpt.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to wte, as in GPT-2
        gpt2_name = "transformer." + name
        for ours, theirs in _GPT2_NAMES:
            gpt2_name = gpt2_name.replace(ours, theirs)
        if tensor.ndim == 2 and name.startswith("blocks."):
            tensor = tensor.t()  # nn.Linear (out, in) -> GPT-2's Conv1D (in, out)
        state[gpt2_name] = tensor.detach().contiguous().clone()
    return state


def gpt2_config(config: ModelConfig) -> dict[str, Any]:
    """A transformers GPT2Config (as JSON) with the built-in GPT's exact shapes and maths."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": 4 * config.n_embd,
        "activation_function": "gelu",  # exact erf GELU, as F.gelu
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
        "dtype": "float32",
    }


def save_gpt_as_gpt2(gpt: GPT, out: Path) -> None:
    save_file(gpt2_state_dict(gpt), str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(gpt2_config(gpt.config), indent=2) + "\n")
