"""The merge's settings: how updates are validated, weighted and applied (merge.pipeline)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from merge.correction import CorrectionConfig
from merge.outer import OuterConfig
from merge.robust import RobustConfig
from merge.weighting import StalenessConfig, TokenWeightConfig


@dataclass(frozen=True, kw_only=True)
class MergeConfig:
    """How updates are validated, weighted and applied; part of the run fingerprint."""

    outer: OuterConfig = field(default_factory=OuterConfig)
    """The outer optimizer applied to each accepted update."""
    staleness: StalenessConfig = field(default_factory=StalenessConfig)
    """How staleness down-weights an update."""
    token_weight: TokenWeightConfig
    """How the tokens behind an update weigh it."""
    max_inner_steps: int
    """Updates claiming more inner steps than this are rejected."""
    max_tokens_per_step: int
    """Updates claiming more than inner_steps * this many tokens are rejected."""
    max_staleness: int = 1000
    """Updates staler than this are rejected."""
    max_update_norm_ratio: float = 1.0
    """Updates whose pseudo-gradient norm exceeds this times the params norm are rejected."""
    max_learners: int = 1024
    """Updates whose header claims more live learners than this are rejected."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Correction of stale updates against the outer momentum before they are applied."""
    robust: RobustConfig = field(default_factory=RobustConfig)
    """Norm bound relative to the median accepted norm; cosine bound to the outer momentum."""
    max_clock_skew_s: float = 600.0
    """Updates sealed more than this many seconds in the future (by our clock) are rejected."""
    max_seq_jump: int = 1_000_000
    """Updates whose seq is this far beyond the author's last applied seq are rejected."""

    def __post_init__(self) -> None:
        for name in ("max_inner_steps", "max_tokens_per_step", "max_learners"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if type(self.max_staleness) is not int or self.max_staleness < 0:
            raise ValueError(f"max_staleness must be an integer >= 0, got {self.max_staleness!r}.")
        ratio = self.max_update_norm_ratio
        if not isinstance(ratio, int | float) or not (math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"max_update_norm_ratio must be a finite number > 0, got {ratio!r}.")
        skew = self.max_clock_skew_s
        if not isinstance(skew, int | float) or not (math.isfinite(skew) and skew > 0):
            raise ValueError(f"max_clock_skew_s must be a finite number > 0, got {skew!r}.")

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON types only."""
        return dataclasses.asdict(self)
