"""The replica's params norm and the bounds carried on it through outer steps, so that an
update near the norm limit needs the exact norm and the others do not read the params. A part
of :class:`merge.replica.Replica` (a mixin: the same methods, moved out of merge/replica.py
unchanged in session 25; they read the replica's params under its lock)."""

from __future__ import annotations

import math
import threading

import torch

NORM_SLACK = 0.05
"""Relative widening of the params-norm bounds at each step they are carried through. They
must hold what ``float(torch.linalg.vector_norm(params))`` would return, and torch's fp32 norm
is off the exact one by ~4e-4 at 10M elements (measured), so they are kept far wider: only an
update within ~5 % of the norm limit needs the exact params norm."""
NORM_MAX_CHAIN = 32
"""Steps the bounds are carried through before the params norm is computed again."""


class NormBounds:
    """Replica's params norm, exact or bounded."""

    # what it reads of Replica (merge.replica), which sets each
    lock: threading.RLock
    params: torch.Tensor
    _norm_bounds: tuple[int, float, float, int] | None

    def params_norm(self) -> float:
        """``float(torch.linalg.vector_norm(params))``: one pass over the params, after which
        :meth:`params_norm_bounds` is exact until the next step."""
        with self.lock:
            norm = float(torch.linalg.vector_norm(self.params))
            version = _tensor_version(self.params)
            self._norm_bounds = None
            if version is not None and math.isfinite(norm):
                self._norm_bounds = (version, norm, norm, 0)
            return norm

    def params_norm_bounds(self) -> tuple[float, float] | None:
        """(lo, hi) around what :meth:`params_norm` would return now, without reading the
        params: carried from the last exact norm through the steps since, each of which moved
        the params by at most |a| times the applied vector's norm. None when unknown (any
        other change to the params, a momentum term, a fragment, no norm given to apply)."""
        with self.lock:
            bounds = self._norm_bounds
            if bounds is None or bounds[0] != _tensor_version(self.params):
                return None
            return bounds[1], bounds[2]

    def _carry_norm_bounds(
        self, before: tuple[float, float] | None, moved: float | None, norm: float | None
    ) -> None:
        """Bounds after a step of |a| = ``moved`` along a vector of ``norm``: the params norm
        changed by at most |a| * norm (triangle inequality), widened by NORM_SLACK for the
        float error of the norms and of the step."""
        chain = 0 if self._norm_bounds is None else self._norm_bounds[3] + 1
        version = _tensor_version(self.params)
        self._norm_bounds = None
        if before is None or moved is None or norm is None or version is None:
            return
        if chain > NORM_MAX_CHAIN or not (math.isfinite(norm) and norm >= 0):
            return
        lo, hi = before
        shift = moved * norm * (1.0 + NORM_SLACK)
        lo, hi = max(0.0, (lo - shift) * (1.0 - NORM_SLACK)), (hi + shift) * (1.0 + NORM_SLACK)
        if math.isfinite(hi):
            self._norm_bounds = (version, lo, hi, chain)


def _tensor_version(tensor: torch.Tensor) -> int | None:
    """Torch's in-place version counter of ``tensor`` (bumped by every in-place op on it or a
    view of it); None for an inference tensor, which has none."""
    try:
        return tensor._version
    except RuntimeError:
        return None
