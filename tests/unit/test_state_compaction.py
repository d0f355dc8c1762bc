"""A checkpoint's training state without zeros and the replica twice, restored exactly."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from node.state_compaction import MARKER, MIN_NUMEL, compact, expand


def _tensors() -> st.SearchStrategy[torch.Tensor]:
    sizes = st.sampled_from([1, 7, MIN_NUMEL, MIN_NUMEL + 5])
    dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.int64])
    kinds = st.sampled_from(["zeros", "random", "one_nonzero"])

    def build(numel: int, dtype: torch.dtype, kind: str) -> torch.Tensor:
        tensor = torch.zeros(numel, dtype=dtype)
        if kind == "random":
            tensor = torch.randn(numel).to(dtype)
        elif kind == "one_nonzero":
            tensor[-1] = 1
        return tensor

    return st.builds(build, sizes, dtypes, kinds)


_KEYS = st.sampled_from(["buf", "acc", "state", "0", "step"])
_states = st.recursive(
    st.one_of(_tensors(), st.integers(), st.floats(allow_nan=False), st.none(), st.text()),
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(_KEYS, children, max_size=3),
    ),
    max_leaves=8,
)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return bool(a == b)


def _saved_bytes(state: Any) -> int:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.tell()


@settings(max_examples=25, deadline=None)
@given(_states)
def test_any_state_comes_back_exactly_and_never_larger(state: Any) -> None:
    compacted = compact(state)
    assert _equal(expand(torch.load(_roundtrip(compacted), weights_only=True)), state)
    assert _saved_bytes(compacted) <= _saved_bytes(state) + 200


def _roundtrip(state: Any) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_a_lone_nodes_partial_round_keeps_one_replica_and_no_zero_momentum() -> None:
    replica = torch.randn(4 * MIN_NUMEL)
    state = {
        "replica": {"outer": {"buf": torch.zeros(4 * MIN_NUMEL)}},
        "partial_round": {"base": replica.clone(), "params": replica + 1},
    }
    compacted = compact(state, replica)
    assert _saved_bytes(compacted) < _saved_bytes(state) / 2.5
    restored = expand(compacted, replica)
    assert _equal(restored, state)
    assert restored["partial_round"]["base"] is not replica  # its own storage, as loaded


@pytest.mark.parametrize(
    "marker",
    [
        {MARKER: "zeros", "shape": [-1], "dtype": "torch.float32"},
        {MARKER: "zeros", "shape": [1 << 40], "dtype": "torch.float32"},
        {MARKER: "zeros", "shape": [3], "dtype": "torch.complex64"},
        {MARKER: "something else"},
    ],
)
def test_a_damaged_marker_is_a_clear_checkpoint_error(tmp_path: Path, marker: dict) -> None:
    layout = [("w", torch.Size([4]))]
    state = {"fingerprint": "f" * 64, "replica": {"params": torch.ones(4), "outer": marker}}
    save_checkpoint(tmp_path, state, layout)
    (training,) = tmp_path.glob("training-*.pt")
    saved = torch.load(training, weights_only=True)
    saved["replica"]["outer"] = marker
    torch.save(saved, training)
    with pytest.raises(CheckpointError, match="damaged"):
        load_checkpoint(tmp_path, "f" * 64, layout)
