"""How often a round in progress is saved (issue 23): as often as its cost allows.

A kill -9 loses the inner steps since the last save (and, with rounds shorter than the period,
the whole round in progress: a round published since its last save is not resumed), so the
period is as short as `min_s` while the copy on the training thread stays under `copy_share`
of that thread's time and the write in the background under `write_share` of the wall time
(each measured, smoothed); never longer than `max_s` (a write that takes longer runs back to
back, one at a time).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SMOOTHING = 0.5
"""Weight of the newest measurement in the running estimate."""


@dataclass
class SaveCadence:
    min_s: float
    max_s: float
    copy_share: float = 0.01
    """At most this share of the training thread's time goes to copying the state."""
    write_share: float = 0.05
    """The background write runs at most this share of the wall time (its CPU and disk)."""
    copy_s: float | None = None
    write_s: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.min_s <= self.max_s or not math.isfinite(self.max_s):
            raise ValueError(f"save periods must be 0 < min <= max, got {self.min_s}, {self.max_s}")
        if not (0 < self.copy_share <= 1 and 0 < self.write_share <= 1):
            raise ValueError("save cost shares must be in (0, 1]")

    def observe_copy(self, seconds: float) -> None:
        self.copy_s = _smoothed(self.copy_s, seconds)

    def observe_write(self, seconds: float) -> None:
        self.write_s = _smoothed(self.write_s, seconds)

    @property
    def period_s(self) -> float:
        needed = max(
            self.min_s,
            (self.copy_s or 0.0) / self.copy_share,
            (self.write_s or 0.0) / self.write_share,
        )
        return min(self.max_s, needed)

    def due(self, since_last_s: float) -> bool:
        return since_last_s >= self.period_s


def _smoothed(previous: float | None, seconds: float) -> float | None:
    if not math.isfinite(seconds) or seconds < 0:
        return previous  # a clock that went backwards measures nothing
    if previous is None:
        return seconds
    return SMOOTHING * seconds + (1 - SMOOTHING) * previous
