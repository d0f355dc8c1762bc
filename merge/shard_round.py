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
them.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from merge.envelope import UpdateHeader
from merge.equivocation import GroupVariants
from merge.group_pipeline import GroupMerge, variant_of
from merge.group_update import GroupUpdate
from merge.outer import _ROUND_TOLERANCE, NesterovShares, OuterOptimizer
from merge.replica import Replica
from merge.result import MergeResult
from merge.robust import Verdict

logger = logging.getLogger(__name__)

Gram = list[list[float]]
"""Dot products among the basis (state tensors, then the round's updates), float64."""
Vector = npt.NDArray[np.float64]
"""Coefficients over the basis."""
_MIN_PARAMS_NORM = 1e-12  # merge.pipeline's floor under the params norm
_SCHWARZ_SLACK = 1e-9
PART_CHUNK = 1 << 16
"""Elements of a slice `part_gram` copies to float64 at once (per basis vector)."""
_STATE_SLACK = 1e-9
"""Relative room for a float64 dot product of the same slices summed in another order."""
NORM_BOUND_SLACK = 1.01
"""`signed_norm_bound`'s widening: bf16 rounding of the mean (2^-8) and float error."""
_SAME_COMBO = 1e-9
"""A state's coefficients on the updates this close (relative) to a combination of the
sums gathered already take no sum of their own."""


def state_tensors(replica: Replica) -> list[torch.Tensor]:
    """The basis' first vectors: the params, then the outer optimizer's state tensors."""
    return [replica.params, *replica.outer.state_tensors()]


def overlapping(bounds: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """The shards (of `bounds`, an incoming update's split) that hold any of [start, end): what
    a member whose slice that is fetches whole to check them against their co-signed digests
    (docs/scale.md, Session 16: the slices must be aligned)."""
    return [k for k, (lo, hi) in enumerate(bounds) if lo < end and start < hi and lo < hi]


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


def gram_problem(gram: object, size: int) -> str | None:
    """Why `gram` cannot be the Gram matrix of `size` real vectors (a member's part, or their
    sum), or None: square of `size`, finite, symmetric, a non-negative diagonal, and each dot
    product within Cauchy-Schwarz. A member cannot claim a cross term its vectors' norms do
    not allow."""
    if not isinstance(gram, list) or len(gram) != size:
        return "gram_shape"
    if not all(isinstance(row, list) and len(row) == size for row in gram):
        return "gram_shape"
    if not all(type(x) is float and math.isfinite(x) for row in gram for x in row):
        return "gram_not_finite"
    if any(gram[i][i] < 0 for i in range(size)):
        return "gram_negative_norm"
    for i in range(size):
        for j in range(i + 1, size):
            if gram[i][j] != gram[j][i]:
                return "gram_asymmetric"
            if abs(gram[i][j]) > math.sqrt(gram[i][i] * gram[j][j]) * (1 + _SCHWARZ_SLACK):
                return "gram_beyond_schwarz"
    return None


@dataclass(frozen=True)
class Incoming:
    """One group update of the round as the merge sees it: what every member derives from
    its signed headers, and the problem that refuses it (`GroupMerge._problem`'s, with the
    members' shard checks in the shard path)."""

    header: UpdateHeader
    learners: int
    problem: str | None
    variant: tuple[tuple[str, ...], tuple[str, ...]]
    cosigners: tuple[str, ...]
    update: GroupUpdate | None = field(default=None, compare=False)
    """The update itself, for `GroupMerge.on_applied` (None: its listeners are not told)."""
    norm_bound: float = math.inf
    """What its signed headers bound its aggregate's norm by (`signed_norm_bound`)."""

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
            signed_norm_bound(update),
        )


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
            slack = _STATE_SLACK * math.sqrt(own[i][i] * own[j][j])
            if abs(part[i][j] - own[i][j]) > slack:
                return "gram_wrong_state"
    return None


def signed_norm_bound(update: GroupUpdate) -> float:
    """A bound on the norm of a group update's aggregate from its signed headers alone: the
    mean of its included members' signed norms (the aggregate is the mean of their parts,
    each clipped to at most its norm: the triangle inequality), widened for the bf16
    rounding of the mean (2^-8 relative) and float error."""
    norms = [h.norm for h in update.contributions]
    if not norms or not all(math.isfinite(n) and n >= 0 for n in norms):
        return math.inf
    return math.fsum(norms) / len(norms) * NORM_BOUND_SLACK


def round_problem(incoming: Sequence[Incoming], gram: object, num_states: int) -> str | None:
    """Why the round's Gram matrix (`summed_gram` of the members' parts, `incoming` in id
    order) cannot be decided on, or None: not a Gram matrix (`gram_problem`), or claiming an
    update (not refused by its headers) longer than its signed headers allow
    (`signed_norm_bound`): a member inflating its part of an update's norm cannot make its
    group refuse (`norm_too_large`) or clip an update whose members signed norms within the
    bounds beyond what they signed."""
    problem = gram_problem(gram, num_states + len(incoming))
    if problem is not None:
        return problem
    assert isinstance(gram, list)
    for i, inc in enumerate(incoming):
        index = num_states + i
        if inc.problem is None and gram[index][index] > inc.norm_bound**2:
            return "gram_beyond_signed_norm"
    return None


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
        self, incoming: Sequence[Incoming], gram: Gram, *, until_fold: bool = False
    ) -> RoundPlan:
        """The decisions of applying `incoming` (in id order: `order`) one by one, from the
        Gram matrix of the basis (`summed_gram`, checked by `round_problem` first: ValueError
        otherwise, the caller's bug). Pure: nothing of the pipeline changes.

        ``until_fold``: stop after the update that completes a Delayed Nesterov round; the
        rest are `RoundPlan.deferred` to the next round. Then the round always gathers one
        sum (the params and the momentum move by multiples of the round's sum), where a fold
        inside it takes two."""
        ordered = self.order(incoming)
        replica = self.merge.pipeline.replica
        with replica.lock:
            num_states = len(state_tensors(replica))
            problem = round_problem(ordered, gram, num_states)
            if problem is not None:
                raise ValueError(f"the round's Gram matrix is not one: {problem}")
            replay = _Replay(replica.outer, num_states, len(ordered))
            decisions = _Decider(self.merge, replay, np.array(gram)).run(ordered, until_fold)
            base = (replica.num_applied, replica.applied_digest())
        combos, formed = _combos(replay, num_states)
        deferred = tuple(ordered[len(decisions) :])
        return RoundPlan(
            base, tuple(decisions), combos, formed, replay.count, replay.progress, deferred
        )

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
            formed = [_form(f, states, gathered) for f in plan.formed]
            results = [self._record(d) for d in plan.decisions]
            replica.params.copy_(formed[0])
            _load_outer(replica.outer, formed[1:], plan.steps, plan.progress)
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
        p.replica.apply(header, torch.empty(0), 0.0, learners=inc.learners, cosigners=inc.cosigners)
        self.merge.variants.applied(inc.uid, *inc.variant)
        if decision.weight > 0:
            p.robust.record(verdict, header.author)
        with p._stats_lock:
            p.num_merged += 1
        return MergeResult(
            True, header.author, header.seq, header.staleness, decision.weight, None,
            inc.learners, 0, verdict.reason, header.inner_steps,
        )  # fmt: skip


def sums_problem(
    plan: RoundPlan, part: Gram, sums: Sequence[torch.Tensor], states: Sequence[torch.Tensor]
) -> str | None:
    """Why a member's gathered slices `sums` do not match the part Gram matrix `part` it sent
    (checked before the decisions were taken, `gram_problem`), or None; `states`: the
    receiver's own slices of its state tensors over that member's part. Each slice's norm and
    its dot product with each state tensor's slice must be what `part` says of that combo of
    the member's shards (within float32 rounding of the sum): a member cannot send a slice
    larger than, or leaning along the momentum or the params more than, the shards it
    reported; what is left to it is the direction orthogonal to the receiver's state, within
    the reported norm (docs/scale.md, Session 16: trust)."""
    num_states = len(states)
    gram = np.array(part)
    if len(sums) != len(plan.combos) or gram.shape != (num_states + plan.size,) * 2:
        return "sums_shape"
    for combo, total in zip(plan.combos, sums, strict=True):
        c = np.array(combo)
        if total.numel() != states[0].numel() or not bool(torch.isfinite(total).all()):
            return "sums_shape"
        block = gram[num_states:, num_states:]
        reach = float(np.abs(c) @ np.sqrt(np.diag(block))) + 1e-30
        slack = 1e-5 * reach
        total64 = total.to(torch.float64)
        if abs(float(total64 @ total64) - float(c @ block @ c)) > slack * (2 * reach + slack):
            return "sums_norm"
        for i, state in enumerate(states):
            expected = float(c @ gram[num_states:, i])
            bound = slack * math.sqrt(max(gram[i][i], 0.0))
            if abs(float(total64 @ state.to(torch.float64)) - expected) > bound + 1e-30:
                return "sums_direction"
    return None


class _Replay:
    """The outer optimizer's arithmetic (merge.outer) replayed on coefficient vectors over
    the basis: each state tensor as a combination of the basis vectors."""

    def __init__(self, outer: OuterOptimizer, num_states: int, num_updates: int) -> None:
        size = num_states + num_updates
        self.kind, self.lr, self.mu = outer.kind, outer.lr, outer.momentum
        self.delay: int | None = getattr(outer, "delay", None)
        self.count, self.progress = outer.round_state()
        self.folds = 0
        unit = np.eye(size)
        self.states = [unit[i].copy() for i in range(num_states)]
        """The params, the momentum (and the delayed optimizer's round sum)."""
        self.num_states = num_states

    def update(self, index: int) -> Vector:
        """The basis vector of the round's `index`-th update."""
        vector = np.zeros(len(self.states[0]))
        vector[self.num_states + index] = 1.0
        return vector

    def momentum_parts(self) -> list[Vector]:
        """As `OuterOptimizer.momentum_parts`."""
        if not self.count:
            return []
        if self.kind != "delayed_nesterov" or self.progress == 0.0:
            return [self.states[1]]
        return [self.states[1], self.states[2]]

    def step(self, vector: Vector, weight: float, learners: int) -> None:
        """As `OuterOptimizer.step` with `vector` as the pseudo-gradient."""
        if self.kind == "delayed_nesterov":
            self._delayed(vector, weight, learners)
        else:
            self._nesterov(vector, weight, learners)
        self.count += 1

    def _delayed(self, vector: Vector, weight: float, learners: int) -> None:
        params, buf, acc = self.states
        share = 1.0 / (self.delay or learners)
        acc = acc + (weight * share) * vector
        params = params + (-self.lr * weight * share) * vector
        self.progress += share
        if self.progress >= 1.0 - _ROUND_TOLERANCE:
            buf = self.mu * buf + acc
            params = params + (-self.lr * self.mu) * buf
            acc = np.zeros_like(acc)
            self.folds += 1
            self.progress = max(0.0, self.progress - 1.0)
            if self.progress < _ROUND_TOLERANCE:
                self.progress = 0.0
        self.states = [params, buf, acc]

    def _nesterov(self, vector: Vector, weight: float, learners: int) -> None:
        params, buf = self.states
        g = vector * weight
        if learners == 1:
            buf = self.mu * buf + g
            params = params - self.lr * (g + self.mu * buf)
        else:
            c = NesterovShares.of(self.mu, learners)
            params = params + (-self.lr * c.grad) * g + (-self.lr * c.look_ahead) * buf
            buf = c.decay * buf + c.gain * g
        self.states = [params, buf]


class _Decider:
    """`GroupMerge.submit`'s decisions for the round's updates in id order, on copies of
    what they read and change (the robust window, the variants, the applied set)."""

    def __init__(self, merge: GroupMerge, replay: _Replay, gram: npt.NDArray[np.float64]):
        self.merge, self.replay, self.gram = merge, replay, gram
        self.robust = copy.deepcopy(merge.pipeline.robust)
        self.variants = GroupVariants()  # this round's applied ids; earlier ones: the merge's
        self.applied: set[tuple[str, int]] = set()

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

    def run(self, ordered: Sequence[Incoming], until_fold: bool) -> list[Decision]:
        decisions = []
        for i, inc in enumerate(ordered):
            decisions.append(self.one(i, inc))
            if until_fold and self.replay.folds:
                break
        return decisions

    def one(self, index: int, inc: Incoming) -> Decision:
        p = self.merge.pipeline
        header, learners = inc.header, inc.learners
        problem = inc.problem
        if problem is None and not 1 <= learners <= p.config.max_learners:
            problem = "group_bad_learners"
        if problem is None and header.staleness > p.config.max_staleness:
            problem = "too_stale"
        if problem is not None:
            return Decision(inc, problem)
        if p.replica.has_applied(*inc.uid) or inc.uid in self.applied:
            known = self.variants if inc.uid in self.applied else self.merge.variants
            culprits = known.equivocators(inc.uid, *inc.variant)
            if culprits is None:
                return Decision(inc, "duplicate")
            return Decision(inc, "group_equivocation", culprits=culprits)
        vector = self.replay.update(index)
        norm = self.norm(vector)
        if norm > p.config.max_update_norm_ratio * max(
            self.norm(self.replay.states[0]), _MIN_PARAMS_NORM
        ):
            return Decision(inc, "norm_too_large")
        return self._applied(inc, vector, norm, learners)

    def _applied(self, inc: Incoming, vector: Vector, norm: float, learners: int) -> Decision:
        p = self.merge.pipeline
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
        if weight != 0:
            self.replay.step(vector, weight, learners)
        self.applied.add(inc.uid)
        self.variants.applied(inc.uid, *inc.variant)
        if weight > 0:
            self.robust.record(verdict, inc.header.author)
        return Decision(inc, None, verdict, weight)


def robust_scale(verdict: Verdict) -> float:
    """The share of an update's weight the verdict lets through (the pipeline's
    `_robust_scale` without its counting): none against the momentum, all of a recentred one
    (its clipping is in the vector), the norm bound's scale otherwise."""
    if verdict.reason is None:
        return 1.0
    if verdict.reason == "against_momentum":
        return 0.0
    return 1.0 if verdict.recenter is not None else verdict.scale


def _combos(
    replay: _Replay, num_states: int
) -> tuple[tuple[tuple[float, ...], ...], tuple[Formed, ...]]:
    """The fewest weighted sums of the updates the state tensors need, and how each state
    tensor is formed. The optimizer's state tensors first, the params last: a round with one
    Delayed Nesterov fold gathers two sums (the shares before the fold, folded into the
    momentum, and after it, the round sum), the params' being a combination of those; one
    without a fold gathers one; a Nesterov momentum two (params and momentum)."""
    combos: list[list[float]] = []
    sums: dict[int, list[float]] = {}
    order = [*range(1, len(replay.states)), 0]
    for index in order:
        row = [float(x) for x in replay.states[index][num_states:]]
        coefficients = _in_span(combos, row)
        if coefficients is None:
            combos.append(row)
            coefficients = [0.0] * (len(combos) - 1) + [1.0]
        sums[index] = coefficients
    formed = tuple(
        Formed(
            tuple(float(x) for x in state[:num_states]),
            tuple(sums[i] + [0.0] * (len(combos) - len(sums[i]))),
        )
        for i, state in enumerate(replay.states)
    )
    return tuple(tuple(c) for c in combos), formed


def _in_span(combos: list[list[float]], row: list[float]) -> list[float] | None:
    """Coefficients that form `row` from `combos` (within rounding), or None. Solved from
    the normal equations with correctly rounded sums (every member forms alike)."""
    if not any(row):
        return [0.0] * len(combos)
    if not combos:
        return None
    k = len(combos)
    system = [
        [math.fsum(x * y for x, y in zip(combos[i], combos[j], strict=True)) for j in range(k)]
        + [math.fsum(x * y for x, y in zip(combos[i], row, strict=True))]
        for i in range(k)
    ]
    coefficients = _solve(system)
    if coefficients is None:
        return None
    largest = max(abs(x) for x in row)
    for n, target in enumerate(row):
        formed = math.fsum(a * combo[n] for a, combo in zip(coefficients, combos, strict=True))
        if abs(formed - target) > _SAME_COMBO * largest:
            return None
    return coefficients


def _solve(system: list[list[float]]) -> list[float] | None:
    """Gaussian elimination with partial pivoting of a small augmented system; None when
    singular."""
    rows = [r[:] for r in system]
    k = len(rows)
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(rows[r][col]))
        if rows[pivot][col] == 0:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(k):
            if r != col:
                factor = rows[r][col] / rows[col][col]
                rows[r] = [x - factor * y for x, y in zip(rows[r], rows[col], strict=True)]
    return [rows[i][k] / rows[i][i] for i in range(k)]


def _form(
    formed: Formed, states: list[torch.Tensor], gathered: Sequence[torch.Tensor]
) -> torch.Tensor:
    """One state tensor at the round's end (a new tensor: the old ones are read after)."""
    out = torch.zeros_like(states[0])
    for coefficient, state in zip(formed.states, states, strict=True):
        if coefficient != 0:
            out.add_(state, alpha=coefficient)
    for coefficient, total in zip(formed.sums, gathered, strict=True):
        if coefficient != 0:
            out.add_(total, alpha=coefficient)
    return out


def _load_outer(
    outer: OuterOptimizer, tensors: list[torch.Tensor], steps: int, progress: float
) -> None:
    """The outer optimizer at the round's end: its state tensors, steps and round share."""
    state: dict[str, object] = {"kind": outer.kind, "buf": tensors[0], "count": steps}
    if len(tensors) > 1:
        state |= {"acc": tensors[1], "progress": progress}
    outer.load_state_dict(state)
