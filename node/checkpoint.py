"""Atomic checkpoints: model weights in safetensors, training state in torch's format.

A checkpoint directory holds one generation of two files and a manifest naming them:

    checkpoint.json           {"format_version": 2, "fingerprint", "weights", "state"}
    model-<gen>.safetensors   the replica (the global model) by parameter name, fp32
    training-<gen>.pt         the rest: outer optimizer, applied set, AdamW state, step,
                              data position and a partial round; read with weights_only=True

Each file is written to a temporary name, fsynced and renamed; the manifest is replaced last,
so a crash at any moment leaves the previous generation or the new one, never a mix. The
weights file loads anywhere with `safetensors.torch.load_file`, without this package.
A version 1 checkpoint (one checkpoint.pt) is still read. The training file holds large
all-zero tensors, and a partial round's base equal to the replica, as small markers
(node.state_compaction); checkpoints written before that load unchanged.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from node.state_compaction import compact, expand

MANIFEST_FILE = "checkpoint.json"
LEGACY_FILE = "checkpoint.pt"
FORMAT_VERSION = 2

Layout = list[tuple[str, torch.Size]]
"""The model's parameters in flat-vector order: (name, shape)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or belongs to another run."""


def split_weights(flat: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    """The flat replica as named tensors (each its own storage, as safetensors requires)."""
    weights: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in layout:
        numel = shape.numel()
        weights[name] = flat[offset : offset + numel].view(shape).clone()
        offset += numel
    if offset != flat.numel():
        raise ValueError(f"layout covers {offset} elements, the replica has {flat.numel()}")
    return weights


def join_weights(weights: dict[str, torch.Tensor], layout: Layout) -> torch.Tensor:
    """The flat replica from named tensors; CheckpointError if names or shapes differ."""
    if set(weights) != {name for name, _ in layout}:
        raise CheckpointError("the weights file holds other parameters than this model's")
    parts = []
    for name, shape in layout:
        tensor = weights[name]
        if tensor.shape != shape or tensor.dtype != torch.float32:
            raise CheckpointError(f"weight {name} is {tuple(tensor.shape)} {tensor.dtype}")
        parts.append(tensor.reshape(-1))
    return torch.cat(parts) if parts else torch.zeros(0)


def save_checkpoint(directory: Path, state: dict[str, Any], layout: Layout) -> Path:
    """Write `state` (its replica params as safetensors); returns the manifest's path.

    `state["replica"]["params"]` is the flat replica; `state["fingerprint"]` names the run.
    """
    directory.mkdir(parents=True, exist_ok=True)
    replica = dict(state["replica"])
    params = replica.pop("params")
    weights = split_weights(params, layout)
    rest = {
        "format_version": FORMAT_VERSION,
        # Zeros and a partial round's base equal to the replica as markers (state_compaction).
        **compact({**state, "replica": replica}, params),
        "param_layout": [(name, list(shape)) for name, shape in layout],
    }
    gen = secrets.token_hex(6)
    weights_name, state_name = f"model-{gen}.safetensors", f"training-{gen}.pt"
    metadata = {"format": "pt", "fingerprint": str(state["fingerprint"])}
    _write_atomic(directory / weights_name, lambda f: f.write(save(weights, metadata=metadata)))
    _write_atomic(directory / state_name, lambda f: torch.save(rest, f))
    manifest = {
        "format_version": FORMAT_VERSION,
        "fingerprint": state["fingerprint"],
        "weights": weights_name,
        "state": state_name,
        # Readable without the training file: export lists nodes by round, and a node of
        # another configuration is told which settings differ.
        "round": state.get("round"),
        "settings": state.get("settings"),
    }
    path = directory / MANIFEST_FILE
    _write_atomic(path, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    _remove_other_generations(directory, keep={weights_name, state_name})
    return path


def read_checkpoint(directory: Path) -> dict[str, Any] | None:
    """The checkpoint in `directory` of whichever run, None if there is none (export, benches):
    the replica's params flat, in the order they were saved. Given a run's directory
    (~/.diloco/checkpoints/RUN_ID) with one node's checkpoint in it, that one."""
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.exists():
        legacy = directory / LEGACY_FILE
        if legacy.exists():
            return _torch_load(legacy)
        nodes = node_checkpoints(directory)
        # A run's directory holding one node's (the default layout): that node's.
        return read_checkpoint(nodes[0]) if len(nodes) == 1 else None
    fingerprint = str(json.loads(manifest_path.read_text()).get("fingerprint"))
    state = load_checkpoint(directory, fingerprint, None)
    assert state is not None
    return state


def node_checkpoints(run_dir: Path) -> list[Path]:
    """The nodes' checkpoint directories in a run's directory (RUN_ID/PEER_ID), sorted."""
    return sorted(d for d in run_dir.glob("*/") if (d / MANIFEST_FILE).exists())


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of the checkpoint in `directory` ({} if it has none or it is unreadable)."""
    try:
        manifest = json.loads((directory / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def checkpoint_round(directory: Path) -> int | None:
    """Rounds done by the checkpoint in `directory`, from its manifest (None: not recorded)."""
    found = read_manifest(directory).get("round")
    return found if type(found) is int else None


def load_checkpoint(
    directory: Path, fingerprint: str, layout: Layout | None
) -> dict[str, Any] | None:
    """The checkpoint in `directory`, None if there is none; CheckpointError if it is unusable.

    `layout`: this model's parameters, which the saved weights must match (None: trust the
    saved layout)."""
    manifest_path = directory / MANIFEST_FILE
    if not manifest_path.exists():
        legacy = directory / LEGACY_FILE
        return _load_legacy(legacy, fingerprint) if legacy.exists() else None
    try:
        manifest = json.loads(manifest_path.read_text())
        weights_path = directory / Path(manifest["weights"]).name
        state_path = directory / Path(manifest["state"]).name
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {manifest_path} is unreadable ({exc})") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {manifest_path} is not a diloco-node checkpoint")
    _check_fingerprint(manifest.get("fingerprint"), fingerprint, directory)
    state = _torch_load(state_path)
    try:
        weights = load_file(weights_path)
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(
            f"checkpoint {weights_path} is corrupt or unreadable ({exc})"
        ) from None
    _check_fingerprint(state.get("fingerprint"), fingerprint, directory)
    replica = state.get("replica")
    if not isinstance(replica, dict):
        raise CheckpointError(f"checkpoint {state_path} has no replica state")
    params = join_weights(weights, layout or _saved_layout(state))
    try:
        state = expand(state, params)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {state_path} is damaged ({exc})") from None
    state["replica"] = {**state["replica"], "params": params}
    return state


def _saved_layout(state: dict[str, Any]) -> Layout:
    try:
        return [(str(name), torch.Size(shape)) for name, shape in state["param_layout"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint has no usable parameter layout ({exc})") from None


def checkpoint_files(directory: Path) -> Iterator[Path]:
    """The files of the current checkpoint (manifest first), for tools and tests."""
    manifest_path = directory / MANIFEST_FILE
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        yield manifest_path
        yield directory / manifest["weights"]
        yield directory / manifest["state"]


def _load_legacy(path: Path, fingerprint: str) -> dict[str, Any]:
    state = _torch_load(path)
    if state.get("format_version") != 1:
        raise CheckpointError(f"checkpoint {path} is not a diloco-node checkpoint")
    _check_fingerprint(state.get("fingerprint"), fingerprint, path.parent)
    return state


def _torch_load(path: Path) -> dict[str, Any]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} is not a diloco-node checkpoint")
    return state


def _check_fingerprint(found: object, expected: str, directory: Path) -> None:
    if found != expected:
        raise CheckpointError(
            f"checkpoint in {directory} belongs to a different run or model configuration; "
            "pass another --checkpoint-dir or the original settings"
        )


def _write_atomic(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Temp file in the same directory, fsync, rename, fsync the directory."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as tmp:
            write(tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _remove_other_generations(directory: Path, keep: set[str]) -> None:
    stale = [*directory.glob("model-*.safetensors"), *directory.glob("training-*.pt")]
    stale += [*directory.glob(".*.tmp")]  # left by a crash mid-write (the dir is locked)
    stale += [directory / LEGACY_FILE] if (directory / LEGACY_FILE).exists() else []
    for path in stale:
        if path.name not in keep:
            path.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["CheckpointError", "Layout", "load_checkpoint", "read_checkpoint", "save_checkpoint"]
