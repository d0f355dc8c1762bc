"""One account of the contribution ledger (merge.contribution): its load decayed along the
others' progress, its tenure, and how an applied update is credited to it."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Account:
    """One author's (or the fresh cohort's) load and record in a ContributionLedger."""

    load: float = 0.0
    """Credited shares, decayed up to `clock`."""
    clock: float = 0.0
    """The others' progress (total - own) when `load` was last brought up to date."""
    own: float = 0.0
    """Its credited shares that advanced the swarm's clock (rounds)."""
    record: float = 0.0
    """Credited updates in all."""
    since: float = 0.0
    """The others' progress when its first update was credited."""
    seen_at: float = 0.0
    """The latest signed time (created_at) of its applied updates."""

    def load_at(self, total: float, tau: float) -> float:
        elapsed = max(0.0, total - self.own - self.clock)
        return self.load * math.exp(-elapsed / tau)

    def tenure(self, total: float) -> float:
        """Rounds of the others' progress since its first credited update."""
        return max(0.0, total - self.own - self.since)

    def credit(
        self,
        share: float,
        allowance: float,
        total: float,
        tau: float,
        *,
        clocked: bool,
        loaded: bool = True,
        evidence: float = 1.0,
        fair: float = 1.0,
    ) -> None:
        """`total`: the swarm's clock before this update; `clocked`: whether it advances it;
        `loaded`: whether it counts against the budget (not when its author is alone); `fair`:
        the steady load of one author at its share of each round, the unit of `load`."""
        if self.record == 0 and self.own == 0:
            self.since = total - self.own
        self.load = self.load_at(total, tau) + (share * allowance / fair if loaded else 0.0)
        self.clock = total - self.own
        self.own += share * allowance if clocked else 0.0
        self.record += allowance * evidence
