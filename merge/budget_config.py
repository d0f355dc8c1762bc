"""The settings of contribution budgets (merge.contribution): caps, decay, what makes an
author established and trusted."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class BudgetConfig:
    """How much of a round an author may contribute; part of the robust config."""

    max_share: float = 4.0
    """An author's cap, in fair shares of a round (0: no budget). Above 1: honest learners
    differ in speed: a learner publishing 4x as often as the others keeps its whole share
    (tests/unit/test_contribution.py), an established attacker gets at most this much."""
    budget_rounds: float = 4.0
    """Time constant, in rounds of the others' progress, over which contributions decay."""
    fresh_share: float = 1.5
    """The cap of each author until it has a track record, in fair shares of a round
    (above 1: one honest newcomer keeps its whole share)."""
    cohort_share: float = 1.5
    """The cap of all fresh authors together once any author is established, in fair shares
    (above 1: one honest newcomer keeps its whole share; one fair share of one more learner,
    tried before, cut it to 0.89-0.93x, by amounts that depended on the arrival order)."""
    min_record: float = 8.0
    """Credited updates after which an author is established (its own budget, its learner
    count credited, its robust vote counted)."""
    min_tenure: float = 4.0
    """Rounds of the others' progress since its first credited update before an author can
    be established: publishing fast in a swarm's first rounds earns no record sooner."""
    trust_rounds: float = 32.0
    """Rounds of the others' progress since an author's first credited update over which
    its cap grows linearly from one fair share to `max_share` (trust built from history:
    publishing faster does not earn it sooner)."""

    def __post_init__(self) -> None:
        names = ("max_share", "fresh_share", "cohort_share", "min_record", "min_tenure")
        for name in (*names, "trust_rounds"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
        tau = self.budget_rounds
        if not isinstance(tau, int | float) or not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"budget_rounds must be a finite number > 0, got {tau!r}.")
