"""A round of other groups' updates merged as one linear step (issue 22, must-have 2;
docs/scale.md, Session 16).

With learner groups a member need not fetch every other group's whole update: each member
fetches its part (a fixed slice of the model) of each, the group sums the members' per-part
scalars, every member derives the same decisions from the sums, each forms weighted sums of
its parts, and one all-gather gives every member the round's combined step. This module is
that merge's pure core.

Everything `GroupMerge.submit` decides from the tensors is a function of dot products among
a few vectors: the update's norm, its dot product with the momentum and the momentum's norm
(the robust judge, `RobustFilter.decide`), the params' norm (the norm cap), and what the
step does is linear in them. Applied one by one in id order, each update's step (the outer
optimizer's plain step, a Delayed Nesterov fold, a recentring toward the momentum) keeps
every tensor of the replica a linear combination of the *basis*: the replica's state tensors
at the round's start (params, momentum, a delayed optimizer's round sum: `state_tensors`) and
the round's updates. So the batch is replayed on coefficient vectors over that basis, each
norm and dot product read from the basis' Gram matrix, which is the sum over the model's
parts of each part's Gram matrix (`part_gram`: what one member computes from its slices).
The folds, the recentring and the robust window changing between updates are replayed in
order, exactly as the sequential path takes them, so none of them breaks the linearity; the
one approximation is float rounding (dot products summed by parts in float64 instead of
whole in float32), which moves a verdict only at a threshold's edge, as the order of
updates already does between replicas (DESIGN.md's consistency model).

At the end each state tensor is a combination of the state tensors (every member holds them
whole) and of a few weighted sums of the updates (`RoundPlan.combos`: one without a fold,
two with one fold or with Nesterov momentum), the only tensors the group all-gathers.
`ShardRound.decide` is pure (it changes nothing); `ShardRound.apply` makes the replica, the
applied set, the co-signer ledger, the robust window, the variants and the counters what
applying the updates one by one through `GroupMerge.submit` in id order would have made
them. Beside it: the round's data (merge.shard_round_plan), the checks of the members'
claims (merge.shard_round_checks), the replay and the forming of the state
(merge.shard_round_replay); their public names are re-exported here.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from merge.contribution import budgeted
from merge.equivocation import GroupVariants
from merge.group_equivocation import AppliedVariant
from merge.group_pipeline import GroupMerge, charge, count_over_budget, floor_votes, sized
from merge.group_update import NORM_BOUND_SLACK, signed_norm_bound
from merge.replica import Replica
from merge.result import MergeResult
from merge.robust import Verdict
from merge.shard_round_cap import CapBound, CapUndecided
from merge.shard_round_checks import gram_problem, round_problem, sums_problem
from merge.shard_round_plan import (
    Decision,
    Formed,
    Gram,
    Incoming,
    RoundPlan,
    Vector,
)
from merge.shard_round_replay import Replay, combos_of, form_state, load_outer
from merge.shard_round_sums import MAX_SUMS, fold_limit, next_cut
from merge.update_checks import MIN_PARAMS_NORM

__all__ = [
    "AwaitedVariant",
    "CapUndecided",
    "MAX_SUMS",
    "NORM_BOUND_SLACK",
    "PART_CHUNK",
    "Decision",
    "Formed",
    "Gram",
    "Incoming",
    "RoundPlan",
    "ShardRound",
    "Vector",
    "gram_problem",
    "part_gram",
    "part_problem",
    "robust_scale",
    "round_problem",
    "signed_norm_bound",
    "STATE_SLACK",
    "state_tensors",
    "summed_gram",
    "sums_problem",
]

logger = logging.getLogger(__name__)

PART_CHUNK = 1 << 16
"""Elements of a slice `part_gram` copies to float64 at once (per basis vector)."""
STATE_SLACK = 1e-5
"""Relative room for a member's dot products among the state tensors' slices: replicas that
applied one set in other orders (a fetch round's fallback to the whole fetch) differ by float
rounding (session 17: 1e-9 refused every fetch round after one); a member moving the
params' or the momentum's norm by 1e-5 of itself moves no verdict but at a threshold's edge."""


def state_tensors(replica: Replica) -> list[torch.Tensor]:
    """The basis' first vectors: the params, then the outer optimizer's state tensors."""
    return [replica.params, *replica.outer.state_tensors()]


def part_gram(vectors: Sequence[torch.Tensor]) -> Gram:
    """One part's Gram matrix: the dot products (float64) of one slice of each basis vector
    (the state tensors' slices, then the member's shard of each update). In chunks of
    PART_CHUNK elements, so the float64 copies stay small whatever the slice's length."""
    size = len(vectors)
    total = torch.zeros(size, size, dtype=torch.float64)
    length = vectors[0].numel() if vectors else 0
    for start in range(0, length, PART_CHUNK):
        chunk = torch.stack([v[start : start + PART_CHUNK] for v in vectors]).to(torch.float64)
        total += chunk @ chunk.T
    upper = total.triu()  # exactly symmetric, whatever order the product summed in
    return (upper + upper.triu(1).T).tolist()


def summed_gram(parts: Sequence[Gram]) -> Gram:
    """The whole model's Gram matrix from its parts' (correctly rounded sums: every member
    gets the same numbers whatever order the parts came in)."""
    size = len(parts[0])
    return [[math.fsum(p[i][j] for p in parts) for j in range(size)] for i in range(size)]


def part_problem(part: object, states: Sequence[torch.Tensor], num_updates: int) -> str | None:
    """Why a member's part Gram matrix cannot be taken, or None: not one of real vectors
    (`gram_problem`), or claiming dot products among the state tensors' slices (`states`:
    the receiver's own, over that member's slice) other than the receiver's. Every member
    holds the state whole, so a member cannot make the params or the momentum look longer
    or shorter than they are (which would move the norm cap and the cosines)."""
    num_states = len(states)
    problem = gram_problem(part, num_states + num_updates)
    if problem is not None:
        return problem
    assert isinstance(part, list)
    own = part_gram(states)
    for i in range(num_states):
        for j in range(i, num_states):
            slack = STATE_SLACK * math.sqrt(own[i][i] * own[j][j])
            if abs(part[i][j] - own[i][j]) > slack:
                return "gram_wrong_state"
    return None


class AwaitedVariant(CapUndecided):
    """A round holding the prevailing variant of an id whose lesser variant this replica
    applied and withdrew (merge.equivocation `awaits`): it steps in that variant's slot
    (Replica.restep: no share of a round, no fold), which the round's replay of fresh steps
    does not model, so the round is fetched whole and applied one by one, as for a cap the
    members' reports leave undecided (a CapUndecided: `MemberRound.failed` reads
    "cap_undecided"). Rare: one replica, one id, once."""


class ShardRound:
    """Decides and applies a round's incoming group updates as one linear step on one
    pipeline's replica (the group merge's), under the replica's lock."""

    def __init__(self, merge: GroupMerge) -> None:
        self.merge = merge

    def order(self, incoming: Sequence[Incoming]) -> list[Incoming]:
        """The round's updates in id order (group key, seq): the order they are decided in,
        and the order of the basis' update vectors (each member's `part_gram` and sums)."""
        return sorted(incoming, key=lambda inc: inc.uid)

    def decide(
        self,
        incoming: Sequence[Incoming],
        gram: Gram,
        *,
        until_fold: bool | int = False,
        max_sums: int = MAX_SUMS,
    ) -> RoundPlan:
        """The decisions of applying `incoming` (in id order: `order`) one by one, from the
        Gram matrix of the basis (`summed_gram`, checked by `round_problem` first: ValueError
        otherwise, the caller's bug). Pure: nothing of the pipeline changes.

        ``until_fold``: stop after the update that completes the first (True) or n-th (n)
        Delayed Nesterov round, the rest `RoundPlan.deferred` (cut at the first: one sum; a
        fold inside takes two, two folds three). A plan asks for at most ``max_sums`` sums,
        else it is cut at the latest fold within (merge.shard_round_sums `next_cut`).

        `CapUndecided` (a ValueError) when the norm cap of an update is not decided by what
        every member checks (merge.shard_round_cap): the round is then fetched whole and
        applied one by one, the way no member's report moves."""
        ordered, limit = self.order(incoming), fold_limit(until_fold)
        while True:
            plan, folds = self._decided(ordered, gram, limit)
            if (limit := next_cut(len(plan.combos), max_sums, folds, limit)) is None:
                return plan

    def _decided(
        self, ordered: list[Incoming], gram: Gram, limit: int | None
    ) -> tuple[RoundPlan, int]:
        """`decide`'s plan stopped after the fold `limit` (None: none), and its folds."""
        replica = self.merge.pipeline.replica
        with replica.lock:
            num_states = len(state_tensors(replica))
            problem = round_problem(ordered, gram, num_states)
            if problem is not None:
                raise ValueError(f"the round's Gram matrix is not one: {problem}")
            replay = Replay(replica.outer, num_states, len(ordered))
            decisions = _Decider(self.merge, replay, np.array(gram)).run(ordered, limit)
            base = (replica.num_applied, replica.applied_digest())
        combos, formed = combos_of(replay, num_states)
        deferred = tuple(ordered[len(decisions) :])
        steps, progress = replay.count, replay.progress
        plan = RoundPlan(base, tuple(decisions), combos, formed, steps, progress, deferred)
        return plan, replay.folds

    @staticmethod
    def weighted_sums(plan: RoundPlan, shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One member's slice of each gathered sum: the weighted sum of its shards (its slice
        of each update, decided and deferred in id order; any tensor for a refused one)."""
        if len(shards) != plan.size:
            raise ValueError("one shard per update of the round, in id order.")
        out = []
        for combo in plan.combos:
            total = torch.zeros(shards[0].numel(), dtype=torch.float64) if shards else None
            for coefficient, shard in zip(combo, shards, strict=True):
                if coefficient != 0 and total is not None:
                    total.add_(shard.to(torch.float64), alpha=coefficient)
            out.append(torch.zeros(0) if total is None else total.to(torch.float32))
        return out

    def apply(self, plan: RoundPlan, gathered: Sequence[torch.Tensor]) -> list[MergeResult]:
        """Applies the round: the state tensors formed from `gathered` (each combo's whole
        weighted sum, its members' slices joined), then each update counted and recorded in
        id order as `GroupMerge.submit` would. ValueError when the replica moved since the
        plan was decided (nothing changed then)."""
        p = self.merge.pipeline
        replica = p.replica
        if len(gathered) != len(plan.combos):
            raise ValueError("one gathered sum per combo of the plan.")
        with replica.lock:
            if (replica.num_applied, replica.applied_digest()) != plan.base:
                raise ValueError("the replica changed since the round was decided.")
            states = state_tensors(replica)
            formed = [form_state(f, states, gathered) for f in plan.formed]
            results = [self._record(d) for d in plan.decisions]
            replica.params.copy_(formed[0])
            load_outer(replica.outer, formed[1:], plan.steps, plan.progress)
        for decision in plan.decisions:
            if decision.reason is None and decision.incoming.update is not None:
                for listener in self.merge.on_applied:
                    listener(decision.incoming.update)
        return results

    def _record(self, decision: Decision) -> MergeResult:
        """What `GroupMerge.submit` counts and records for one update (the step aside)."""
        p, inc = self.merge.pipeline, decision.incoming
        header = inc.header
        if decision.reason is not None:
            if decision.reason == "group_equivocation":
                logger.warning(
                    "group update %s#%d: a second variant, co-signed by %s",
                    *inc.uid,
                    decision.culprits,
                )
            return p._reject(header, decision.reason)
        verdict = decision.verdict
        assert verdict is not None
        p._robust_scale(header, verdict)  # counted and logged as the sequential path does
        learners, stepped, allowance = decision.learners, decision.stepped, decision.allowance
        count_over_budget(p, header, allowance)
        p.replica.apply(
            header, torch.empty(0), 0.0, learners=stepped, credited=allowance,
            cosigners=inc.cosigners,
        )  # fmt: skip
        self.merge.variants.applied(inc.uid, *inc.variant)
        if inc.evidence is not None:  # a second variant of it then makes a proof here too
            round_ = inc.uid[1] - 1
            entry = AppliedVariant(p.run_id or "", round_, inc.evidence, decision.weight, stepped)
            self.merge.applied_variants.applied(inc.uid, entry)
        sizing = (header.author, inc.learners, learners)
        charge(p.ledger, p.learner_floor, inc.cosigners, sizing, allowance, verdict)
        if decision.weight > 0:
            p.robust.record(verdict, header.author)
            p.learner_floor.applied(header.author, inc.learners, None)
        with p._stats_lock:
            p.num_merged += 1
        return MergeResult(
            True, header.author, header.seq, header.staleness,
            decision.weight * learners / stepped, None, learners, 0, verdict.reason,
            header.inner_steps,
        )  # fmt: skip


class _Decider:
    """`GroupMerge.submit`'s decisions for the round's updates in id order, on copies of
    what they read and change (the robust window, the learner floor, the contribution ledger,
    the co-signers, the variants, the applied set)."""

    def __init__(self, merge: GroupMerge, replay: Replay, gram: npt.NDArray[np.float64]):
        self.merge, self.replay, self.gram = merge, replay, gram
        self.robust = copy.deepcopy(merge.pipeline.robust)
        self.floor = copy.deepcopy(merge.pipeline.learner_floor)
        self.ledger = copy.deepcopy(merge.pipeline.ledger)
        self.cosigned: dict[str, set[str]] = {}  # this round's; earlier ones: the replica's
        self.variants = GroupVariants()  # this round's applied ids; earlier ones: the merge's
        self.applied: set[tuple[str, int]] = set()
        norms = [math.sqrt(max(0.0, float(gram[i, i]))) for i in range(replay.num_states)]
        self.cap = CapBound(merge.pipeline, merge.pipeline.replica.outer, norms)

    def form(self, a: Vector, b: Vector) -> float:
        """<a, b> through the Gram matrix, correctly rounded (alike on every machine)."""
        size = len(a)
        return math.fsum(
            float(a[i]) * float(self.gram[i, j]) * float(b[j])
            for i in range(size)
            if a[i] != 0
            for j in range(size)
            if b[j] != 0
        )

    def norm(self, a: Vector) -> float:
        return math.sqrt(max(0.0, self.form(a, a)))

    def run(self, ordered: Sequence[Incoming], until_fold: int | None) -> list[Decision]:
        decisions = []
        for i, inc in enumerate(ordered):
            decision = self.one(i, inc)
            if decision is None:
                raise CapUndecided(f"the norm cap of {inc.uid} after {i} updates")
            decisions.append(decision)
            if until_fold is not None and self.replay.folds >= until_fold:
                self._deferred_caps(ordered[i + 1 :])
                break
        return decisions

    def _deferred_caps(self, deferred: Sequence[Incoming]) -> None:
        """The caps of the updates deferred past the fold: applied after this round, on the
        params its members' sums formed, so they too must be decided by what every member
        checks (merge.shard_round_cap), else CapUndecided."""
        seen = set(self.applied)
        for inc in deferred:
            if self._header_problem(inc) is not None or inc.uid in seen:
                continue
            if self.merge.pipeline.replica.has_applied(*inc.uid):
                continue  # an awaited variant among them fails the next round (AwaitedVariant)
            cap = self.cap.decide(inc.norm_bound, MIN_PARAMS_NORM)
            if cap == "undecided":
                raise CapUndecided(f"the norm cap of {inc.uid}, deferred past the fold")
            if cap == "admit":
                self.cap.step(inc.header, inc.learners, inc.norm_bound)
                seen.add(inc.uid)

    def _awaited(self, inc: Incoming) -> bool:
        """Whether `inc` is the prevailing variant of an id whose lesser variant this replica
        applied and withdrew: it steps in that variant's slot (`GroupMerge.submit`)."""
        p = self.merge.pipeline
        return p.replica.has_applied(*inc.uid) and p.equivocation.awaits(inc.uid, inc.variant)

    def _header_problem(self, inc: Incoming) -> str | None:
        p = self.merge.pipeline
        if inc.problem is None and not 1 <= inc.learners <= p.config.max_learners:
            return "group_bad_learners"
        if inc.problem is None and inc.header.staleness > p.config.max_staleness:
            return "too_stale"
        return inc.problem

    def one(self, index: int, inc: Incoming) -> Decision | None:
        p = self.merge.pipeline
        header = inc.header
        problem = self._header_problem(inc)
        if problem is not None:
            return Decision(inc, problem)
        if p.equivocation.refuses(inc.uid, inc.variant):  # as `GroupMerge.submit`
            return Decision(inc, "group_equivocation")
        if inc.uid not in self.applied and self._awaited(inc):
            raise AwaitedVariant(f"{inc.uid} steps in the slot of a withdrawn variant here")
        if p.replica.has_applied(*inc.uid) or inc.uid in self.applied:
            known = self.variants if inc.uid in self.applied else self.merge.variants
            culprits = known.equivocators(inc.uid, *inc.variant)
            if culprits is None:
                return Decision(inc, "duplicate")
            return Decision(inc, "group_equivocation", culprits=culprits)
        # The cap by the signed bound, as `GroupMerge.submit`, for every params' norm the
        # earlier updates leave possible (merge.shard_round_cap): no member's part moves it.
        cap = self.cap.decide(inc.norm_bound, MIN_PARAMS_NORM)
        if cap == "undecided":
            return None  # the round falls back to the whole fetch
        if cap == "refuse":
            return Decision(inc, "norm_too_large")
        self.cap.step(header, inc.learners, inc.norm_bound)
        vector = self.replay.update(index)
        return self._applied(inc, vector, self.norm(vector))

    def _applied(self, inc: Incoming, vector: Vector, norm: float) -> Decision:
        p = self.merge.pipeline
        key = inc.header.author
        learners = sized(self.floor, key, inc.learners, floor_votes(self.ledger, self.cosigners))
        weight = p.weight_of(inc.header, learners)
        parts = self.replay.momentum_parts()
        momentum = sum(parts, np.zeros(len(vector)))
        dot = math.fsum(self.form(vector, part) for part in parts) if parts and norm > 0 else None
        verdict = self.robust.decide(norm, dot, lambda: self.norm(momentum))
        weight *= robust_scale(verdict)
        if verdict.recenter is not None:
            pull = (1.0 - verdict.recenter) * verdict.center
            vector = vector * (verdict.scale * verdict.recenter) + sum(
                (part * pull for part in parts), np.zeros(len(vector))
            )
        allowance = self.ledger.group_allowance(inc.cosigners, learners)
        stepped, weight = budgeted(learners, weight, allowance, p.config.max_learners)
        if weight != 0:
            self.replay.step(vector, weight, stepped)
        self.applied.add(inc.uid)
        self.variants.applied(inc.uid, *inc.variant)
        self.cosigned.setdefault(key, set()).update(inc.cosigners)
        charge(
            self.ledger,
            self.floor,
            inc.cosigners,
            (key, inc.learners, learners),
            allowance,
            verdict,
        )
        if weight > 0:
            self.robust.record(verdict, key)
            self.floor.applied(key, inc.learners, None)
        return Decision(
            inc, None, verdict, weight, learners=learners, stepped=stepped, allowance=allowance
        )

    def cosigners(self, group_key: str) -> frozenset[str]:
        """The co-signers of `group_key`'s applied updates, this round's decided ones too."""
        known = self.merge.pipeline.replica.cosigned.cosigners(group_key)
        return known | self.cosigned.get(group_key, set())


def robust_scale(verdict: Verdict) -> float:
    """The share of an update's weight the verdict lets through (the pipeline's
    `_robust_scale` without its counting): none against the momentum, all of a recentred one
    (its clipping is in the vector), the norm bound's scale otherwise."""
    if verdict.reason is None:
        return 1.0
    if verdict.reason == "against_momentum":
        return 0.0
    return 1.0 if verdict.recenter is not None else verdict.scale
