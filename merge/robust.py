"""Robust merging: take no harm from well-signed updates that would hurt the model.

A norm cap relative to the parameters (the pipeline's `max_update_norm_ratio`) stops gross
updates, but a hostile peer can stay just under it: honest pseudo-gradients are ~10 % of the
parameter norm, so a cap of 1x leaves room for updates ten times larger than anyone else's,
and a well-scaled update can still point against the training direction. Two checks close
that gap, both pure functions of the replica's state and the update:

- norm outlier: once `warmup` updates are accepted, an update whose norm exceeds
  `max_norm_to_median` times the median norm of the last `window` applied updates is
  clipped to that bound (counted as `norm_outlier`; the window records it at the bound);
- against momentum: an update whose cosine to the outer optimizer's momentum (the direction
  the swarm has been moving in) is below `min_cosine` contributes nothing (counted as
  `against_momentum`): it would undo the swarm's progress rather than add to it.

Neither verdict refuses the update's id: the pipeline applies it with its contribution
clipped or zeroed. The median window and the momentum are the same on every replica only up
to the order of the last few updates (the consistency model of DESIGN.md), so two replicas
can judge an update near a threshold differently; were that a refusal, their applied sets
would differ for good (measured with bench.scale at N = 4 and 8 before this rule). As it is,
they keep one applied set and differ at most by one clipped contribution, which the drift
figure shows. Thresholds sit far from honest values (honest norms stay within ~2x of the
median, honest cosines are positive: tests/unit/test_merge_robust.py and docs/trust.md).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

REASONS = ("norm_outlier", "against_momentum")


@dataclass(frozen=True, kw_only=True)
class RobustConfig:
    """Thresholds of the robust checks; part of the run fingerprint (every replica uses them)."""

    window: int = 32
    """Accepted update norms the median is taken over."""
    warmup: int = 4
    """Accepted updates before the relative norm bound applies."""
    max_norm_to_median: float = 4.0
    """Updates with a norm above this times the median accepted norm are clipped to it (0: off)."""
    min_cosine: float = -0.5
    """Updates whose cosine to the outer momentum is below this contribute nothing (-1: off)."""

    def __post_init__(self) -> None:
        if type(self.window) is not int or self.window < 1:
            raise ValueError(f"robust window must be an integer >= 1, got {self.window!r}.")
        if type(self.warmup) is not int or not 1 <= self.warmup <= self.window:
            raise ValueError(
                f"robust warmup must be an integer in [1, window], got {self.warmup!r}."
            )
        ratio = self.max_norm_to_median
        if not isinstance(ratio, int | float) or not (math.isfinite(ratio) and ratio >= 0):
            raise ValueError(f"max_norm_to_median must be a finite number >= 0, got {ratio!r}.")
        if not isinstance(self.min_cosine, int | float) or not -1 <= self.min_cosine <= 1:
            raise ValueError(f"min_cosine must be in [-1, 1], got {self.min_cosine!r}.")


@dataclass(frozen=True)
class Verdict:
    """What the robust checks decided about one update, with the figures they used."""

    reason: str | None
    norm: float
    median_norm: float | None
    cosine: float | None
    """The cosine to the momentum; None without one, or when the update does not point
    against it by enough to need the momentum's norm (cosine >= 0)."""


class RobustFilter:
    """The running median of accepted norms; callers hold the replica's lock around it."""

    def __init__(self, config: RobustConfig) -> None:
        self.config = config
        self._norms: deque[float] = deque(maxlen=config.window)

    def __len__(self) -> int:
        """Norms in the window."""
        return len(self._norms)

    def judge(
        self,
        pseudo_gradient: torch.Tensor,
        momentum: torch.Tensor | Sequence[torch.Tensor] | None,
        norm: float | None = None,
    ) -> Verdict:
        """The verdict on one decoded, finite update (of ``norm``, when the caller has it);
        pure: it changes no state.

        ``momentum`` is the direction the swarm has been moving in, or parts that sum to it
        (the outer optimizer's momentum and the shares not yet folded into it): the update's
        dot product with it is the sum of its dot products with the parts, so the sum itself
        is never materialised. The momentum's norm is computed only when the cosine bound could
        refuse the update: not for one along the momentum (dot product >= 0 with a negative
        bound), whose verdict leaves the cosine out (None).
        """
        if norm is None:
            norm = float(torch.linalg.vector_norm(pseudo_gradient))
        median = self.median_norm()
        bound = self.config.max_norm_to_median
        parts = _parts(momentum)
        if median is not None and bound > 0 and norm > bound * median:
            return Verdict("norm_outlier", norm, median, _cosine(pseudo_gradient, norm, parts))
        cosine = None
        if parts and norm > 0 and self.config.min_cosine > -1:
            dot = _dot(pseudo_gradient, parts)
            # cos >= 0 > min_cosine needs no norm of the momentum; NaN falls through.
            if not (dot >= 0 and self.config.min_cosine < 0):
                cosine = _cosine_of(dot, norm, parts)
        if cosine is not None and cosine < self.config.min_cosine:
            return Verdict("against_momentum", norm, median, cosine)
        return Verdict(None, norm, median, cosine)

    def accepted(self, verdict: Verdict) -> None:
        """Records the norm of an update that was applied."""
        self._norms.append(verdict.norm)

    def record(self, verdict: Verdict) -> None:
        """Records what an applied update contributed: its norm, or for a clipped one the
        bound it was clipped to; a zeroed one (against the momentum) records nothing.

        An update at the bound is recorded the same, so a clipped update moves the median no
        further than an unclipped one could. Recording only unclipped norms froze the bound:
        once honest norms outgrew it (the inner lr's warm-up, error feedback's residual
        building up, a fragment's first partial round in the window), every later update was
        clipped and none moved the median again (bench.slowlink, sparse with 4 fragments: the
        embedding's fragment clipped for good).
        """
        if verdict.reason is None:
            self.accepted(verdict)
        elif verdict.reason == "norm_outlier" and verdict.median_norm is not None:
            bound = self.config.max_norm_to_median * verdict.median_norm
            self._norms.append(min(verdict.norm, bound))

    def median_norm(self) -> float | None:
        """The median accepted norm, or None during warm-up."""
        if len(self._norms) < self.config.warmup:
            return None
        return statistics.median(self._norms)

    def state_dict(self) -> dict[str, object]:
        return {"norms": list(self._norms)}

    def load_state_dict(self, state: dict[str, object]) -> None:
        norms = state.get("norms")
        if not isinstance(norms, list) or not all(
            isinstance(n, float) and math.isfinite(n) and n >= 0 for n in norms
        ):
            raise ValueError("robust state 'norms' must be a list of finite norms.")
        self._norms = deque(norms[-self.config.window :], maxlen=self.config.window)


def _parts(momentum: torch.Tensor | Sequence[torch.Tensor] | None) -> list[torch.Tensor]:
    if momentum is None:
        return []
    return [momentum] if isinstance(momentum, torch.Tensor) else list(momentum)


def _dot(g: torch.Tensor, parts: list[torch.Tensor]) -> float:
    """<g, sum(parts)> as a sum of dot products: one pass over each part, no temporary."""
    return math.fsum(float(torch.dot(g, part)) for part in parts)


def _cosine(g: torch.Tensor, g_norm: float, parts: list[torch.Tensor]) -> float | None:
    if not parts or g_norm == 0:
        return None
    return _cosine_of(_dot(g, parts), g_norm, parts)


def _cosine_of(dot: float, g_norm: float, parts: list[torch.Tensor]) -> float | None:
    """The cosine from the dot product; None when the momentum is zero or not finite."""
    m_norm = float(torch.linalg.vector_norm(parts[0])) if len(parts) == 1 else _norm_of_sum(parts)
    if m_norm == 0 or not math.isfinite(m_norm):
        return None
    return dot / g_norm / m_norm  # not over their product, which can underflow to 0


def _norm_of_sum(parts: list[torch.Tensor]) -> float:
    """|sum(parts)| from the parts' pairwise dot products: no model-sized temporary."""
    squared = math.fsum(
        (1.0 if i == j else 2.0) * float(torch.dot(parts[i], parts[j]))
        for i in range(len(parts))
        for j in range(i, len(parts))
    )
    if math.isfinite(squared) and squared > 1e-30:
        return math.sqrt(squared)
    # Squares that under- or overflow: the norm of the materialised sum, which torch scales.
    return float(torch.linalg.vector_norm(torch.stack(parts).sum(0)))
