"""The node's replica of the global model: flat parameters, outer optimizer, applied set."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Mapping

import torch

from merge.envelope import UpdateHeader
from merge.outer import OuterOptimizer


class Replica:
    """The global model as this node has merged it; every access goes through ``lock``.

    The replica owns ``params``: the caller must not modify the tensor it passes in. Readers
    that need a consistent copy use :meth:`snapshot`.
    """

    def __init__(self, params: torch.Tensor, outer: OuterOptimizer) -> None:
        if not isinstance(params, torch.Tensor) or params.dim() != 1:
            raise ValueError("replica params must be a 1-D tensor.")
        if params.dtype != torch.float32 or params.device.type != "cpu":
            raise ValueError(f"replica params must be fp32 on CPU, got {params.dtype}.")
        if outer.numel != params.numel():
            raise ValueError(
                f"outer optimizer is sized for {outer.numel} elements, params have "
                f"{params.numel()}."
            )
        self.lock = threading.RLock()
        self.params = params.detach()
        self.outer = outer
        self._applied: dict[str, set[int]] = {}
        self._last_seq: dict[str, int] = {}
        self._num_applied = 0

    @property
    def numel(self) -> int:
        return self.params.numel()

    @property
    def num_applied(self) -> int:
        with self.lock:
            return self._num_applied

    @property
    def applied(self) -> dict[str, list[int]]:
        """A copy of the applied set: author -> sorted seqs."""
        with self.lock:
            return {author: sorted(seqs) for author, seqs in self._applied.items()}

    def last_seq(self, author: str) -> int:
        """The highest seq applied from ``author``, or -1."""
        with self.lock:
            return self._last_seq.get(author, -1)

    def has_applied(self, author: str, seq: int) -> bool:
        with self.lock:
            return seq in self._applied.get(author, ())

    def apply(self, header: UpdateHeader, pseudo_gradient: torch.Tensor, weight: float) -> None:
        """Steps the outer optimizer with the update and records its id.

        An update of weight 0 contributes nothing: its id is recorded, the params and the outer
        optimizer's state stay as they are.
        """
        with self.lock:
            if self.has_applied(header.author, header.seq):
                raise ValueError(f"update {header.update_id} has already been applied.")
            if weight != 0:
                learners = 1 if header.learners is None else header.learners
                self.outer.step(self.params, pseudo_gradient, weight, learners)
            self._record(header.author, header.seq)

    def snapshot(self) -> tuple[torch.Tensor, int]:
        """A copy of the params and the number of updates they include, taken atomically."""
        with self.lock:
            return self.params.clone(), self._num_applied

    def applied_digest(self) -> str:
        """SHA-256 hex of the lexicographically sorted "author:seq\\n" lines of the applied set."""
        with self.lock:
            lines = sorted(f"{a}:{s}\n" for a, seqs in self._applied.items() for s in seqs)
        return hashlib.sha256("".join(lines).encode()).hexdigest()

    def state_dict(self) -> dict[str, object]:
        """Copies of everything; loadable with torch.load(weights_only=True)."""
        with self.lock:
            return {
                "params": self.params.clone(),
                "outer": self.outer.state_dict(),
                "applied": self.applied,
                "num_applied": self._num_applied,
            }

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        params = state.get("params")
        if not isinstance(params, torch.Tensor) or params.shape != self.params.shape:
            raise ValueError(f"replica state must hold params of shape {tuple(self.params.shape)}.")
        if params.dtype != torch.float32:
            raise ValueError(f"replica state params must be fp32, got {params.dtype}.")
        outer = state.get("outer")
        if not isinstance(outer, Mapping):
            raise ValueError("replica state lacks the outer optimizer state.")
        applied = _parse_applied(state.get("applied"))
        num_applied = state.get("num_applied")
        if type(num_applied) is not int or num_applied != sum(map(len, applied.values())):
            raise ValueError("replica state num_applied does not match its applied set.")
        with self.lock:
            self.outer.load_state_dict(outer)
            self.params.copy_(params)
            self._applied, self._last_seq, self._num_applied = {}, {}, 0
            for author, seqs in applied.items():
                for seq in seqs:
                    self._record(author, seq)

    def _record(self, author: str, seq: int) -> None:
        self._applied.setdefault(author, set()).add(seq)
        self._last_seq[author] = max(seq, self._last_seq.get(author, -1))
        self._num_applied += 1


def _parse_applied(applied: object) -> dict[str, set[int]]:
    if not isinstance(applied, Mapping):
        raise ValueError("replica state 'applied' must map authors to lists of seqs.")
    parsed: dict[str, set[int]] = {}
    for author, seqs in applied.items():
        if not isinstance(author, str) or not isinstance(seqs, list | tuple):
            raise ValueError("replica state 'applied' must map authors to lists of seqs.")
        if not all(type(seq) is int and seq >= 0 for seq in seqs) or len(set(seqs)) != len(seqs):
            raise ValueError(f"replica state 'applied' has invalid seqs for {author}.")
        parsed[author] = set(seqs)
    return parsed
