"""What a checkpoint's training file need not hold twice: tensors of zeros and a partial
round's base that is the replica itself.

A node's training state holds several model-sized tensors (docs/newcomer.md lists them).
Some are all zeros for long stretches (the outer momentum before the first outer step, the
delayed Nesterov accumulator right after a fold, an error-feedback residual at the start),
and a partial round's base (the replica the round started from) is the replica itself until
a peer's update is merged mid-round, as on a lone node. `compact` writes a small marker in
their place and `expand` restores them exactly: resuming is bit-for-bit the same.
"""

from __future__ import annotations

from typing import Any

import torch

MARKER = "__elided__"
"""Key of a marker dict standing in for a tensor."""
ZEROS, REPLICA = "zeros", "replica_params"
MIN_NUMEL = 1024
"""Smaller tensors are kept as they are (the marker would save nothing worth it)."""
MAX_NUMEL = 1 << 36
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)}


def compact(state: Any, replica_params: torch.Tensor | None = None) -> Any:
    """`state` with large all-zero float tensors and, where it equals `replica_params`, the
    partial round's base replaced by markers (new containers; tensors are not copied)."""
    if isinstance(state, dict) and isinstance(state.get("partial_round"), dict):
        partial = state["partial_round"]
        base = partial.get("base")
        if _same(base, replica_params):
            state = {**state, "partial_round": {**partial, "base": {MARKER: REPLICA}}}
    return _elide_zeros(state)


def expand(state: Any, replica_params: torch.Tensor | None = None) -> Any:
    """The state `compact` was given; ValueError for a marker it could not have written."""
    if isinstance(state, dict):
        if MARKER in state:
            return _restore(state, replica_params)
        return {key: expand(value, replica_params) for key, value in state.items()}
    if isinstance(state, list):
        return [expand(value, replica_params) for value in state]
    return state


def _same(base: object, replica_params: torch.Tensor | None) -> bool:
    return (
        isinstance(base, torch.Tensor)
        and replica_params is not None
        and base.shape == replica_params.shape
        and base.dtype == replica_params.dtype
        and torch.equal(base, replica_params)
    )


def _elide_zeros(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        if state.is_floating_point() and state.numel() >= MIN_NUMEL and not bool(state.any()):
            return {MARKER: ZEROS, "shape": list(state.shape), "dtype": str(state.dtype)}
        return state
    if isinstance(state, dict):
        return {key: _elide_zeros(value) for key, value in state.items()}
    if isinstance(state, list):
        return [_elide_zeros(value) for value in state]
    return state


def _restore(marker: dict[str, Any], replica_params: torch.Tensor | None) -> torch.Tensor:
    kind = marker[MARKER]
    if kind == REPLICA and replica_params is not None:
        return replica_params.clone()
    if kind == ZEROS:
        shape, dtype = marker.get("shape"), _DTYPES.get(str(marker.get("dtype")))
        if isinstance(shape, list) and _plausible(shape) and dtype is not None:
            return torch.zeros(shape, dtype=dtype)
    raise ValueError(f"checkpoint holds an unknown or damaged marker ({str(marker)[:100]})")


def _plausible(shape: list[Any]) -> bool:
    """A shape a model's tensor could have (a damaged file must not allocate terabytes)."""
    if not all(type(n) is int and n >= 0 for n in shape):
        return False
    return torch.Size(shape).numel() <= MAX_NUMEL
