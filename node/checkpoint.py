"""Atomic checkpoints of the replica and the learner: temp file, fsync, rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_FILE = "checkpoint.pt"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or belongs to another run."""


def save_checkpoint(directory: Path, state: dict[str, Any]) -> Path:
    """Write `state` so that a crash at any moment leaves either the old or the new file."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_FILE
    fd, tmp_name = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as tmp:
            torch.save({"format_version": FORMAT_VERSION, **state}, tmp)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(directory)
    return path


def read_checkpoint(directory: Path) -> dict[str, Any] | None:
    """The checkpoint in `directory` of whichever run, None if there is none (for export)."""
    path = directory / CHECKPOINT_FILE
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable ({exc})") from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} is not a diloco-node checkpoint")
    return state


def load_checkpoint(directory: Path, fingerprint: str) -> dict[str, Any] | None:
    """The checkpoint in `directory`, None if there is none; CheckpointError if it is unusable."""
    path = directory / CHECKPOINT_FILE
    state = read_checkpoint(directory)
    if state is None:
        return None
    if state.get("fingerprint") != fingerprint:
        raise CheckpointError(
            f"checkpoint {path} belongs to a different run or model configuration; "
            "pass another --checkpoint-dir or the original settings"
        )
    return state


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
