"""The replica's state as a checkpoint or a state transfer holds it: saved, loaded (checked
first, all or nothing), and the settled point of its params or of another replica's state. A
part of :class:`merge.replica.Replica` (a mixin: the same methods, moved out of
merge/replica.py unchanged in session 25; they read the replica's fields under its lock)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from merge.cosign_ledger import CosignLedger, parse_cosigned
from merge.fragments import FragmentLayout
from merge.outer import OuterOptimizer
from merge.replica_state import parse_applied, settled
from merge.weighing_journal import CreditedSum


class Saved:
    """Replica's state_dict, its loading, and the settled params."""

    # what it reads of Replica (merge.replica), which sets or defines each
    lock: threading.RLock
    params: torch.Tensor
    layout: FragmentLayout | None
    outers: list[OuterOptimizer]
    credit: CreditedSum
    cosigned: CosignLedger
    _applied: dict[str, set[int]]
    _last_seq: dict[str, int]
    _num_applied: int
    _version: int
    _record: Callable[[str, int], None]
    if TYPE_CHECKING:

        @property
        def applied(self) -> dict[str, list[int]]: ...

    def settled_at(
        self, index: torch.Tensor, state: Mapping[str, object] | None = None
    ) -> torch.Tensor:
        """The params at flat positions ``index`` (int64) once the outer momentum has played
        out with no further update, in float64 (of ``state``, a state_dict of a replica like
        this one, when given: ValueError if it is malformed).

        A function of the applied set alone: replicas that applied the same updates in
        different orders hold params apart by their momentum tail, but settle to the same
        point (OuterOptimizer.rest_terms), which is what drift compares.
        """
        if state is None:
            with self.lock:
                terms = [outer.rest_terms() for outer in self.outers]
                return settled(self.params, terms, self.layout, index)
        params = state.get("params")
        outer = state.get("outer")
        if not isinstance(params, torch.Tensor) or params.shape != self.params.shape:
            raise ValueError(f"replica state must hold params of shape {tuple(self.params.shape)}.")
        if params.dtype != torch.float32 or not isinstance(outer, Mapping):
            raise ValueError("replica state must hold fp32 params and an outer optimizer state.")
        states = [outer] if self.layout is None else outer.get("fragments")
        if not isinstance(states, list) or len(states) != len(self.outers):
            raise ValueError(f"replica state must hold {len(self.outers)} fragment outer states.")
        if not all(isinstance(s, Mapping) for s in states):
            raise ValueError("replica state's fragment outer states must be mappings.")
        terms = [o.rest_terms(s) for o, s in zip(self.outers, states, strict=True)]
        return settled(params, terms, self.layout, index)

    def state_dict(self) -> dict[str, object]:
        """Copies of everything; loadable with torch.load(weights_only=True)."""
        with self.lock:
            return {
                "params": self.params.clone(),
                "outer": self._outer_state(),
                "applied": self.applied,
                "num_applied": self._num_applied,
                "num_credited": self.credit.total,
                "cosigned": self.cosigned.counts(),
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
        applied = parse_applied(state.get("applied"))
        num_applied = state.get("num_applied")
        if type(num_applied) is not int or num_applied != sum(map(len, applied.values())):
            raise ValueError("replica state num_applied does not match its applied set.")
        credited = state.get("num_credited", num_applied)  # a state from before: all whole
        if type(credited) not in (int, float) or not 0 <= credited <= num_applied:  # type: ignore[operator]
            raise ValueError("replica state num_credited must be a number in [0, num_applied].")
        cosigned = parse_cosigned(state.get("cosigned"), applied)
        with self.lock:
            self._load_outer_state(outer)
            self.params.copy_(params)
            self._applied, self._last_seq, self._num_applied = {}, {}, 0
            self._version += 1
            for author, seqs in applied.items():
                for seq in seqs:
                    self._record(author, seq)
            self.credit.total = float(credited)  # type: ignore[arg-type]
            self.credit._journal_reset()
            self.cosigned.load(cosigned)

    def _outer_state(self) -> dict[str, object]:
        """The optimizer's state; with fragments, {"fragments": [one state per fragment]}."""
        if self.layout is None:
            return self.outers[0].state_dict()
        return {"fragments": [outer.state_dict() for outer in self.outers]}

    def _load_outer_state(self, state: Mapping[str, object]) -> None:
        if self.layout is None:
            self.outers[0].load_state_dict(state)
            return
        states = state.get("fragments")
        if not isinstance(states, list) or len(states) != len(self.outers):
            raise ValueError(f"replica state must hold {len(self.outers)} fragment outer states.")
        if not all(isinstance(s, Mapping) for s in states):
            raise ValueError("replica state's fragment outer states must be mappings.")
        backups = [outer.state_dict() for outer in self.outers]
        try:
            for outer, fragment_state in zip(self.outers, states, strict=True):
                outer.load_state_dict(fragment_state)
        except ValueError:  # all or nothing: a bad fragment state leaves the others as they were
            for outer, backup in zip(self.outers, backups, strict=True):
                outer.load_state_dict(backup)
            raise
