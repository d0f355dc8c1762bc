"""The norm cap of a sharded round decided from data every member checks (merge.shard_round;
docs/scale.md, Session 21: the cap past the round's first update).

`GroupMerge.submit` refuses a group update whose signed norm bound is over
`max_update_norm_ratio` x the params' norm *after the round's earlier updates*. The round
path reads that norm from the Gram matrix, whose cross terms among the updates (and between
the updates and the params) are the members' claims: a member deflating its slices of an
earlier update moves it (hypothesis found an update 12.5 % over the cap refused whole and
applied by parts, after an earlier update claiming one learner took a whole outer step).

What no member moves: the params', the momentum's and the round sum's norms at the round's
start (the state block of the matrix, checked by every member against its own state:
`part_problem`), the headers (signed) and the decisions taken from them. From those,
`CapBound` bounds how far the params can have moved in *any* world the members' reports
leave open, whatever the robust verdicts there were: each earlier update not refused by its
headers or the cap steps with at most its header's weight (the staleness weight is at most
1), its applied vector is at most its signed bound long (an honest aggregate is: the
property test of `signed_norm_bound`; the robust judge only clips it, and centered clipping
with a radius of at least 2 reference norms only shortens it: the result lies between the
update and a center the reference long, and a deviation past 2 references means the update
is longer than the center), and its share of an outer step is at most 1 / its claim (the
floor only raises the count). The optimizer's arithmetic then bounds the displacement D
(`merge.outer`: below). The cap of update u is decided when it is the same for every norm in
[|p0| - D, |p0| + D]; otherwise the round is not decided by parts at all (`CapUndecided`):
its members fetch it whole and apply it one by one, as when any check fails. Deferring u to
the next round would not do: the round's applied part already moved the replica by the
members' sums, so the next round's params are the liar's world's. The round's first update
always decides (D = 0: the params' norm is the checked state's). Whether a round is decided
reads headers and the checked state only, so no member can make its group fall back.
"""

from __future__ import annotations

import math
from typing import Literal

from merge.envelope import UpdateHeader
from merge.group_pipeline import Pipeline
from merge.outer import _ROUND_TOLERANCE, OuterOptimizer
from merge.weighting import token_weight

CAP_SLACK = 1e-5
"""Relative room for the params' norm at the round's start: the whole path reads it in float32
from the tensor, the round path in float64 from the checked state block (STATE_SLACK)."""
MIN_EXACT_RADIUS = 2.0
"""The centered-clipping radius (in reference norms) from which a recentred update is never
longer than the update itself (merge.robust `_recenter`)."""

CapDecision = Literal["refuse", "admit", "undecided"]


class CapUndecided(ValueError):
    """A round whose norm cap is not decided by what every member checks: fetch it whole."""


class CapBound:
    """How far the round's earlier updates can have moved the params, in any world the
    members' reports leave open; fed in id order with the updates not refused."""

    def __init__(self, pipeline: Pipeline, outer: OuterOptimizer, state_norms: list[float]) -> None:
        self.config, self.kind = pipeline.config, outer.kind
        self.lr, self.mu = float(outer.lr), float(outer.momentum)
        self.delay: int | None = getattr(outer, "delay", None)
        radius = pipeline.robust.config.center_radius
        self.vector_bounded = radius == 0 or radius >= MIN_EXACT_RADIUS
        self.params = state_norms[0]
        self.buf = state_norms[1] if len(state_norms) > 1 else 0.0
        self.acc = state_norms[2] if len(state_norms) > 2 else 0.0
        self.progress = outer.round_state()[1]
        self.steps = 0.0
        """The params' displacement by the updates' own terms (lr x weight x share x norm)."""
        self.pushed = 0.0
        """What the updates can have added to the round sum (or the momentum): sum of
        weight x share x norm."""
        self.look_ahead = 0.0
        """Nesterov's momentum terms: lr x mu^2 x |momentum| summed over the steps."""
        self.stepped = False

    def displacement(self) -> float:
        """An upper bound on |params now - params at the round's start|."""
        if not self.stepped:
            return 0.0
        if not self.vector_bounded:
            return math.inf
        if self.kind != "delayed_nesterov":
            return self.steps + self.look_ahead
        folds = math.floor(self.progress + _ROUND_TOLERANCE)
        acc = self.acc + self.pushed
        buf = self.buf + folds * acc  # mu <= 1: each fold adds at most the round sum
        return self.steps + folds * self.lr * self.mu * (self.mu * buf + acc)

    def decide(self, norm_bound: float, min_norm: float) -> CapDecision:
        """Whether the cap refuses an update of this signed bound, for every params' norm the
        round's earlier updates leave possible."""
        ratio = self.config.max_update_norm_ratio
        if not self.stepped:  # the params' norm is the checked state block's
            return "refuse" if norm_bound > ratio * max(self.params, min_norm) else "admit"
        moved = self.displacement() + CAP_SLACK * self.params
        if norm_bound > ratio * max(self.params + moved, min_norm):
            return "refuse"
        if norm_bound <= ratio * max(self.params - moved, min_norm):
            return "admit"
        return "undecided"

    def step(self, header: UpdateHeader, claim: int, norm_bound: float) -> None:
        """An update the headers and the cap let through, whatever its verdict and weight."""
        weight = token_weight(self.config.token_weight, header.tokens)
        share = 1.0 / (self.delay or claim)
        self.stepped = True
        if self.kind == "delayed_nesterov":
            self.pushed += weight * share * norm_bound
            self.steps += self.lr * weight * share * norm_bound
            self.progress += share
            return
        # Nesterov (merge.outer.NesterovShares, any learner count m >= claim): grad <= (1 +
        # mu) / m, look_ahead <= mu^2, gain <= 1, decay <= 1.
        momentum = self.buf + self.pushed
        self.steps += self.lr * (1.0 + self.mu) / claim * weight * norm_bound
        self.look_ahead += self.lr * self.mu * self.mu * momentum
        self.pushed += weight * norm_bound
