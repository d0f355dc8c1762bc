"""Checkpoints: safetensors weights + torch training state, switched atomically by a manifest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from node.checkpoint import CheckpointError, load_checkpoint, read_checkpoint, save_checkpoint

LAYOUT = [("a.weight", torch.Size([2, 3])), ("b.bias", torch.Size([4]))]


def _state(value: float, **extra: Any) -> dict[str, Any]:
    return {
        "fingerprint": "f" * 64,
        "round": int(value),
        "replica": {"params": torch.full((10,), value), "num_applied": 0},
        **extra,
    }


def test_a_saved_checkpoint_loads_back_and_reads_without_a_model(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _state(1.0), LAYOUT)
    state = load_checkpoint(tmp_path, "f" * 64, LAYOUT)
    assert state is not None and state["round"] == 1
    assert torch.equal(state["replica"]["params"], torch.full((10,), 1.0))
    read = read_checkpoint(tmp_path)
    assert read is not None and torch.equal(read["replica"]["params"], torch.full((10,), 1.0))


def test_a_failed_write_keeps_the_previous_checkpoint_and_no_debris(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _state(1.0), LAYOUT)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(Exception):  # noqa: B017  (torch cannot pickle a lambda)
        save_checkpoint(tmp_path, _state(2.0, bad=lambda: None), LAYOUT)
    state = load_checkpoint(tmp_path, "f" * 64, LAYOUT)
    assert state is not None and state["round"] == 1
    save_checkpoint(tmp_path, _state(3.0), LAYOUT)
    after = sorted(p.name for p in tmp_path.iterdir())
    assert len(after) == len(before) == 3 and after != before  # one new generation, no temp


def test_another_run_or_model_is_refused(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, _state(1.0), LAYOUT)
    with pytest.raises(CheckpointError, match="different run"):
        load_checkpoint(tmp_path, "e" * 64, LAYOUT)
    other = [("a.weight", torch.Size([3, 2])), ("b.bias", torch.Size([4]))]
    with pytest.raises(CheckpointError, match="a.weight"):
        load_checkpoint(tmp_path, "f" * 64, other)


def test_a_version_1_checkpoint_is_still_read(tmp_path: Path) -> None:
    torch.save({"format_version": 1, **_state(5.0)}, tmp_path / "checkpoint.pt")
    state = load_checkpoint(tmp_path, "f" * 64, LAYOUT)
    assert state is not None and torch.equal(state["replica"]["params"], torch.full((10,), 5.0))
    save_checkpoint(tmp_path, _state(6.0), LAYOUT)
    assert not (tmp_path / "checkpoint.pt").exists()  # replaced by the new format
