"""Merging a learner group's update (docs/scale.md, wiring plan step 5): the replica's side of
`UpdatePipeline.submit_group`, kept beside the pipeline rather than in it.

A group update is applied as one unit under its group key as author (seq: its round + 1; a
duplicate id is refused): every member's signature and co-signature checked
(`GroupUpdate.problem`), sized by the learner floor over the epoch's learner count (groups)
its members signed (`sized`: a group of one adversary's keys signing learners = 1 counts as
the other authors' claims say, not as a whole outer step), weighed by its staleness and its
mean member's tokens, judged by the robust checks (clip and momentum checks) like any
update, and let through as far as its co-signers' contribution budgets allow (`charge`:
each member charged 1/(g M) of a round in the one ledger, the update allowed what its median
co-signer's account allows; budgets held by group keys stalled the swarm at the first
regrouping: docs/scale.md, sessions 20 and 21). The norm cap refuses it
by its signed norm bound (`signed_norm_bound`: its members' signed norms, clipped as the
reduction clips them), not by its aggregate's norm, so a group that decides a round from its
members' per-part figures (merge.shard_round) refuses exactly what this refuses, whatever one
of its members reports.
Its staleness comes from signed facts: each member signs the applied counts of its own
replica at its round's start and at its contribution; the group's is the median of its
included members' (one member claiming a stale or fresh round moves it no more than one of
g), the same on every replica.

Listeners (`GroupMerge.on_applied`) hear of each group update applied here, on the merge's
thread: a member takes back a contribution it carried for a round it gave up on that
completed at the others (merge.group_carry).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from typing import Any, Protocol

import torch

from merge.contribution import ContributionLedger, budgeted
from merge.envelope import UpdateHeader
from merge.equivocation import Action, EquivocationBook, GroupVariants, UpdateId
from merge.group_equivocation import (
    AppliedVariant,
    AppliedVariants,
    GroupProof,
    GroupRun,
    GroupVariant,
)
from merge.group_update import GroupUpdate, ReductionConfig, is_group_author, signed_norm_bound
from merge.learners import LearnerFloor
from merge.rejections import RejectionLog
from merge.replica import Replica
from merge.result import MergeResult
from merge.robust import RobustFilter, Verdict, substance
from merge.settle import settle
from merge.weighing_journal import WeighingJournal

logger = logging.getLogger(__name__)
MAX_PENDING = 4
"""Refused second variants held for the proof that would make them prevail (each holds a
whole aggregate: a few only)."""


class Pipeline(Protocol):
    """What of merge.pipeline.UpdatePipeline a group update is merged with (it imports this
    module, so this one names it by what it uses)."""

    replica: Replica
    config: Any
    fingerprint: str
    run_id: str | None
    robust: RobustFilter
    num_merged: int
    _stats_lock: threading.Lock
    equivocation: EquivocationBook
    group_run: GroupRun | None
    rejections: Any
    rejection_log: RejectionLog
    learner_floor: LearnerFloor
    ledger: ContributionLedger
    weighing: WeighingJournal
    admit: Callable[[str], bool] | None

    def floor_votes(self) -> tuple[Callable[[str], bool], bool]: ...
    def weight_of(self, header: UpdateHeader, learners: int | None = None) -> float: ...
    def _reject(self, header: UpdateHeader, reason: str) -> MergeResult: ...
    def _norm_reason(self, update_norm: float) -> str | None: ...
    def _robust_scale(self, header: UpdateHeader, verdict: Verdict) -> float: ...


class GroupMerge:
    """Applies learner groups' updates to one pipeline's replica (thread-safe through it)."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.on_applied: list[Callable[[GroupUpdate], object]] = []
        """Told of each group update applied here (after it is, outside the replica's lock)."""
        self.on_superseded: list[Callable[[UpdateId, GroupUpdate | None], object]] = []
        """Told, outside the replica's lock, when the variant applied under an id changes: a
        withdrawn one (None: nothing of the id is applied here to serve), the prevailing one
        stepped in its place (dht.retention replaces the copy it serves)."""
        self.variants = GroupVariants()
        """The variant applied under each recent group id (a second one is equivocation)."""
        self.applied_variants = AppliedVariants()
        """What a second variant makes a proof with, and what a proof withdraws (this path's
        applied ids; merge.shard_round records `variants` only)."""
        self.pending: OrderedDict[UpdateId, tuple[GroupUpdate, Callable[[str], bool]]] = (
            OrderedDict()
        )
        """Second variants refused here that would prevail over the applied one, until the
        pair's proof comes (`learn_proof` then steps with it); the newest MAX_PENDING."""
        self.reduction = ReductionConfig()
        """The run's group reduction settings (the run fingerprint holds them): its clip
        bound sizes `signed_norm_bound`. Set by the node when groups are on; every replica of
        a run must hold the same (the default is the settings' default)."""

    def submit(self, update: GroupUpdate, in_group: Callable[[str], bool]) -> MergeResult:
        """Verifies and applies `update` as one unit; never raises for bad input.
        ``in_group``: whether a peer id is a member of the update's group (dht.grouping)."""
        p = self.pipeline
        header = update.update_header(p.fingerprint, p.config.max_inner_steps)
        claim = update.head.learners  # whole updates: no fragments, a count always signed
        problem = self._problem(update, in_group)
        if problem is None and not 1 <= claim <= p.config.max_learners:
            problem = "group_bad_learners"
        if problem is None and header.staleness > p.config.max_staleness:
            problem = "too_stale"
        if problem is not None:
            return p._reject(header, problem)
        with p.replica.lock:
            uid, variant = (header.author, header.seq), variant_of(update)
            if p.equivocation.refuses(uid, variant):  # proven, or the lesser of a pair
                return p._reject(header, "group_equivocation")
            replaces = p.equivocation.awaits(uid, variant)  # steps where the lesser was
            if p.replica.has_applied(*uid) and not replaces:
                culprits = self.variants.equivocators(uid, *variant)
                if culprits is None:
                    return p._reject(header, "duplicate")
                logger.warning(
                    "group update %s#%d: a second variant, co-signed by %s", *uid, culprits
                )
                self._hold(uid, update, in_group)
                return p._reject(header, "group_equivocation")
            # The cap by the signed bound, never the aggregate's own norm: the same refusal
            # as a group that decides the round from its members' per-part figures.
            if (reason := p._norm_reason(signed_norm_bound(update, self.reduction))) is not None:
                return p._reject(header, reason)
            # in float64, as a fetch round reads it from its Gram matrix: the robust window
            # records it, and a float32 norm of a 446k-value model is ~2.5e-6 short, which
            # left members on one applied set deciding combos ~1e-5 apart (sums29)
            norm = float(torch.linalg.vector_norm(update.aggregate, dtype=torch.float64))
            learners = sized(p.learner_floor, header.author, claim, p.floor_votes())
            weight = p.weight_of(header, learners)
            direction = p.replica.outer.momentum_parts()
            verdict = p.robust.judge(update.aggregate, direction, norm, voters=None)
            weight *= p._robust_scale(header, verdict)
            cosigners = update.reducers()
            allowance = p.ledger.group_allowance(cosigners, learners)
            count_over_budget(p, header, allowance)
            stepped, weight = budgeted(learners, weight, allowance, p.config.max_learners)
            clipped = p.robust.clipped(update.aggregate, direction, verdict)
            if replaces:
                p.replica.restep(
                    header, clipped, weight, learners=stepped, credited=allowance,
                    cosigners=cosigners,
                )  # fmt: skip
                p.equivocation.replaced(uid)
                self.pending.pop(uid, None)
            else:
                p.replica.apply(
                    header, clipped, weight, None, learners=stepped, credited=allowance,
                    cosigners=cosigners,
                )  # fmt: skip
            self.variants.applied(uid, *variant)
            head = update.head
            entry = AppliedVariant(
                head.run_id, head.round, GroupVariant.of(update), weight, stepped, allowance
            )
            self.applied_variants.applied(uid, entry)
            charge(
                p.ledger,
                p.learner_floor,
                cosigners,
                (header.author, claim, learners),
                allowance,
                verdict,
            )
            if weight > 0:  # what moved the replica votes on the floor (merge.pipeline)
                p.robust.record(verdict, header.author)
                p.learner_floor.applied(header.author, claim, None)
        with p._stats_lock:
            p.num_merged += 1
        for listener in self.on_applied:
            listener(update)
        if replaces:
            self._superseded(uid, update)
        # Reported as sized by `learners`: weight / learners is the share of a round it moved.
        return MergeResult(
            True, header.author, header.seq, header.staleness, weight * learners / stepped,
            None, learners, 0, verdict.reason, header.inner_steps,
        )  # fmt: skip

    def evidence(self, update: GroupUpdate) -> GroupProof | None:
        """The proof of a group's equivocation `update` (verified) makes with the variant
        applied here under its id, if they differ; None where groups are off."""
        p = self.pipeline
        if p.group_run is None:
            return None
        uid = (update.head.group_key, update.seq)
        with p.replica.lock:
            return self.applied_variants.conflict(uid, update, p.group_run)

    def learn_proof(
        self, proof: GroupProof, applied_group: Callable[[UpdateId], GroupUpdate | None]
    ) -> Action:
        """Settles a group's proven equivocation as merge.equivocation's rule settles an
        author's, the same on every replica: the id stays (or is now) applied and contributes
        nothing. `applied_group`: the variant applied here (its retained copy), whose outer
        step is withdrawn and whose co-signers' credit is taken back."""
        p, uid = self.pipeline, proof.update_id
        if p.group_run is None or p.replica.layout is not None:
            return "none"  # groups off; a run with fragments takes no group updates
        if p.admit is not None and not all(map(p.admit, proof.signers())):
            count_rejection(p, uid[0], "group_not_allowed")  # neither settled nor passed on
            return "none"  # a permissioned run: a variant of keys off the list is nobody's
        with p.replica.lock:
            action = settle(
                p.equivocation, p.replica, proof,
                recorded=lambda: self._recorded(uid),
                withdraw=lambda: self._withdraw(uid, applied_group, proof),
                applied_variant=self.variants.key_of(uid),
            )  # fmt: skip
            held = self._held(uid)
        if action == "withdraw":
            self._superseded(uid, None)
        if held is not None:  # the prevailing variant came before the proof
            self.submit(*held)
        if action in ("withdraw", "record"):
            count_rejection(p, uid[0], "group_equivocation")
            logger.warning(
                "group update %s#%d: equivocation proven (co-signed both: %s); %s",
                *uid, proof.culprits, action,
            )  # fmt: skip
        return action

    def _superseded(self, uid: UpdateId, update: GroupUpdate | None) -> None:
        for listener in self.on_superseded:
            listener(uid, update)

    def _recorded(self, uid: UpdateId) -> UpdateHeader:
        """The header a proven id is recorded under where no variant of it was applied."""
        p = self.pipeline
        return UpdateHeader(
            fingerprint=p.fingerprint, author=uid[0], seq=uid[1], base_applied=0,
            published_applied=0, inner_steps=p.config.max_inner_steps, tokens=1, loss=0.0,
            payload_sha256="0" * 64, codec="fp32", numel=p.replica.numel, created_at=0.0,
        )  # fmt: skip

    def _hold(self, uid: UpdateId, update: GroupUpdate, in_group: Callable[[str], bool]) -> None:
        """Keeps a refused second variant that includes more members than the applied one:
        where the pair's proof comes after it, it steps in place of the withdrawn lesser one
        (`_held`) rather than wait to be fetched again."""
        known = self.variants.key_of(uid)
        if known is None or len(update.contributions) <= len(known[1]):
            return
        self.pending[uid] = (update, in_group)
        self.pending.move_to_end(uid)
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)

    def _held(self, uid: UpdateId) -> tuple[GroupUpdate, Callable[[str], bool]] | None:
        """The held variant of `uid` this replica now awaits (`EquivocationBook.awaits`)."""
        held = self.pending.get(uid)
        if held is None or not self.pipeline.equivocation.awaits(uid, variant_of(held[0])):
            return None
        return held

    def _withdraw(
        self,
        uid: UpdateId,
        applied_group: Callable[[UpdateId], GroupUpdate | None],
        proof: GroupProof,
    ) -> None:
        """Takes back the applied variant's step and co-signer credit, the id then withdrawn
        here (`EquivocationBook.withdrew`); where it cannot, the variant is kept and no other
        variant steps in its place."""
        p, entry = self.pipeline, self.applied_variants.get(uid)
        p.weighing.tag = None  # what follows is no update's to take back
        if entry is None:
            logger.warning("group update %s#%d: applied too long ago (or by shards); kept", *uid)
            return
        update = applied_group(uid) if entry.weight != 0 else None
        if entry.weight != 0 and (update is None or variant_of(update) != entry.variant.key):
            logger.warning("group update %s#%d: its applied aggregate is gone; kept", *uid)
            return
        if update is not None:
            header = update.update_header(p.fingerprint, p.config.max_inner_steps)
            slot = proof.superseded_key is not None  # the prevailing variant steps in its slot
            p.replica.withdraw(
                header, update.aggregate, entry.weight, entry.learners, slot=slot
            )  # fmt: skip
        reducers = entry.variant.reducers()
        p.replica.cosigned.debit(uid[0], reducers)
        if not p.weighing.take_back(uid):  # journaled no longer: kept, but counted once
            untraced(p, uid, entry.credited, reducers)
        self.applied_variants.forget(uid)
        p.equivocation.withdrew(uid)  # superseded: the prevailing one steps when it comes

    def _problem(self, update: GroupUpdate, in_group: Callable[[str], bool]) -> str | None:
        """Why every replica refuses `update` (counted as `group_<reason>`), or None."""
        p = self.pipeline
        problem = update.problem(in_group)
        if problem is None and (
            update.aggregate.numel() != p.replica.numel or p.replica.layout is not None
        ):
            problem = "wrong_size"  # a whole-model aggregate; runs with fragments have none
        if problem is None and p.run_id not in (None, update.head.run_id):
            problem = "wrong_run"
        # a permissioned run: every key that signed it is on the list, so keys ground into
        # the group's prefix neither join a variant nor make one prevail (docs/trust.md)
        admit = p.admit
        if problem is None and admit is not None:
            problem = None if all(map(admit, GroupVariant.of(update).signers())) else "not_allowed"
        return None if problem is None else f"group_{problem}"


def untraced(pipeline: Pipeline, uid: UpdateId, credited: float, reducers: Collection[str]) -> None:
    """A withdrawn variant whose records the weighing journal no longer holds (applied long
    ago, or before a restart): its norm, claim and charge stay where they are, as before the
    journal; its credited share comes off the progress (a variant steps in its place with
    its own), and its co-signers' records stay within what they applied and co-signed."""
    p = pipeline
    logger.warning("group update %s#%d: its records are no longer journaled; kept", *uid)
    count_rejection(p, uid[0], "group_traces_kept")
    p.replica.credit.add(-min(credited, p.replica.credit.total))
    applied = p.replica.applied  # a copy; a proof is rare
    for member in set(reducers):
        limit = len(applied.get(member, ())) + p.replica.cosigned.count(member)
        p.ledger.bound_record(member, limit)


def sized(
    floor: LearnerFloor, group_key: str, claim: int, votes: tuple[Callable[[str], bool], bool]
) -> int:
    """The learner count a group update claiming `claim` is sized by: the learner floor's
    (`floor`: the pipeline's, or the sharded round's copy of it), the group key as author,
    `votes` as for solo updates (`floor_votes`). Every claim in the window votes: members
    sign no time (docs/scale.md, wiring plan step 5)."""
    voters, cohort = votes
    return floor.effective(group_key, claim, voters, cohort, None)


def floor_votes(
    ledger: ContributionLedger, cosigners: Callable[[str], Collection[str]]
) -> tuple[Callable[[str], bool], bool]:
    """Whose learner claims vote on the floor on their own, and whether the fresh keys vote
    together as one (merge.learners): a solo author as the ledger counts it
    (`ContributionLedger.individually_counted`); a group key while most of the members that
    co-signed its applied updates (`cosigners`: the co-sign ledger's, merge.cosign_ledger)
    are counted on their own: fresh keys ground into group keys vote no more than fresh
    solo keys, and an honest group's new key after a regrouping votes at once (its members
    are the old groups'). While no author is established (a swarm's first rounds) every
    group key votes on its own, as before budgets: members earn record in proportion to the
    groups seen over the groups claimed, so in the first round the honest groups' members
    fall short of a whole update's record while a liar claiming one learner has it at once
    (a rule by records would hand the first rounds' floor to the liars). The fresh keys as
    one cohort while no author is established."""
    established = ledger.any_established()
    counted = ledger.individually_counted()

    def votes(author: str) -> bool:
        if not is_group_author(author):
            return counted(author)
        if not established:
            return True
        members = cosigners(author)
        return 2 * sum(1 for m in members if counted(m)) > len(members)

    return votes, not established


def charge(
    ledger: ContributionLedger,
    floor: LearnerFloor,
    cosigners: Collection[str],
    sizing: tuple[str, int, int],
    allowance: float,
    verdict: Verdict,
) -> None:
    """Charges an applied group update to its co-signers' accounts (`group_applied`), with
    the record a solo update earns: in proportion to the authors seen over its claim and to
    its substance (merge.pipeline). `sizing`: (group key, its claim, the count it was sized
    by). Before the update enters the floor's window, as on the solo path; the one rule for
    the whole path and the sharded round (each on its own ledger and floor)."""
    group_key, claim, learners = sizing
    evidence = min(1.0, floor.num_authors(group_key) / claim) * substance(verdict)
    ledger.group_applied(cosigners, learners, allowance, evidence)


def count_rejection(pipeline: Pipeline, author: str, reason: str) -> None:
    """Counts an update of `author` refused, cut or voided for `reason`: in the pipeline's
    totals and in its per-peer log (merge.rejections), solo and group paths alike."""
    with pipeline._stats_lock:
        pipeline.rejections[reason] += 1
    pipeline.rejection_log.count(author, reason)


def count_over_budget(pipeline: Pipeline, header: UpdateHeader, allowance: float) -> None:
    """Counts and logs an update its budget lets through only in part (a solo author's own,
    a group update's co-signers': merge.contribution)."""
    if allowance >= 1:
        return
    count_rejection(pipeline, header.author, "over_budget")
    logger.info("%s#%d: over its budget; %.3g of it counts", *header.update_id, allowance)


def variant_of(update: GroupUpdate) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What tells two variants of one group id apart: shard digests and included members."""
    return update.shard_digests, tuple(h.author for h in update.contributions)
