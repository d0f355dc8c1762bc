"""The data of a round of other groups' updates merged as one linear step
(merge.shard_round; docs/scale.md, Session 16): the updates as the merge sees them
(`Incoming`), what it decided (`Decision`) and the plan that forms the replica's state from
the gathered sums (`RoundPlan`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from merge.envelope import UpdateHeader
from merge.group_equivocation import GroupVariant
from merge.group_pipeline import GroupMerge, variant_of
from merge.group_update import GroupUpdate, signed_norm_bound
from merge.robust import Verdict

Gram = list[list[float]]
"""Dot products among the basis (state tensors, then the round's updates), float64."""
Vector = npt.NDArray[np.float64]
"""Coefficients over the basis."""


@dataclass(frozen=True)
class Incoming:
    """One group update of the round as the merge sees it: what every member derives from
    its signed headers, and the problem that refuses it (`GroupMerge._problem`'s, with the
    members' shard checks in the shard path)."""

    header: UpdateHeader
    learners: int
    """The learner count its members signed: its claim (sized by the learner floor when it
    is decided, `Decision.learners`)."""
    problem: str | None
    variant: tuple[tuple[str, ...], tuple[str, ...]]
    cosigners: tuple[str, ...]
    update: GroupUpdate | None = field(default=None, compare=False)
    """The update itself, for `GroupMerge.on_applied` (None: its listeners are not told)."""
    norm_bound: float = math.inf
    """What its signed headers bound its aggregate's norm by (`signed_norm_bound`): what the
    norm cap refuses it by, on every path."""
    evidence: GroupVariant | None = field(default=None, compare=False)
    """The variant as its reducers co-signed it: kept once applied, so a second variant of
    its id makes a proof here (merge.group_equivocation), on either path."""

    @property
    def uid(self) -> tuple[str, int]:
        return self.header.author, self.header.seq

    @classmethod
    def of(
        cls, merge: GroupMerge, update: GroupUpdate, in_group: Callable[[str], bool]
    ) -> Incoming:
        """A whole update's (its aggregate at hand)."""
        p = merge.pipeline
        header = update.update_header(p.fingerprint, p.config.max_inner_steps)
        problem = merge._problem(update, in_group)
        return cls(
            header,
            update.head.learners,
            problem,
            variant_of(update),
            update.reducers(),
            update,
            signed_norm_bound(update, merge.reduction),
            GroupVariant.of(update),
        )


@dataclass(frozen=True)
class Decision:
    """What the merge decided about one update of the round."""

    incoming: Incoming
    reason: str | None
    """The refusal (counted as the sequential path counts it), or None: applied."""
    verdict: Verdict | None = None
    weight: float = 0.0
    culprits: tuple[str, ...] = ()
    """Members that co-signed two variants of one id (reason `group_equivocation`)."""
    learners: int = 0
    """The learner count an applied update is sized by (the learner floor's,
    merge.group_pipeline.sized); 0 for a refused one."""
    stepped: int = 0
    """The learner count its outer step is taken by: `learners` raised where its co-signers'
    budgets let through only part of it (merge.contribution.budgeted)."""
    allowance: float = 1.0
    """The share of it its co-signers' budgets let through (`group_allowance`)."""


@dataclass(frozen=True)
class Formed:
    """A state tensor at the round's end: a combination of the state tensors at its start
    (`states`) and of the all-gathered weighted sums of the updates (`sums`, one
    coefficient per `RoundPlan.combos`)."""

    states: tuple[float, ...]
    sums: tuple[float, ...]


@dataclass(frozen=True)
class RoundPlan:
    """The round's decisions, and how the replica's state is formed from the gathered sums."""

    base: tuple[int, str]
    """(applied count, applied digest) the plan was decided on: applied to no other state."""
    decisions: tuple[Decision, ...]
    """In id order: the order they are counted and recorded in."""
    combos: tuple[tuple[float, ...], ...]
    """Coefficients of each weighted sum over the round's updates (`decisions`' order, then
    `deferred`'s, whose are 0)."""
    formed: tuple[Formed, ...]
    """The params, then each of the outer optimizer's state tensors (`state_tensors`)."""
    steps: int
    progress: float
    """The outer optimizer's (steps taken, share of the round done) at the end."""
    deferred: tuple[Incoming, ...] = ()
    """The round's updates after a Delayed Nesterov fold, left for the next round
    (`decide`'s ``until_fold``): in id order, after `decisions` in the basis."""

    @property
    def size(self) -> int:
        """The round's updates in the basis: decided and deferred."""
        return len(self.decisions) + len(self.deferred)
