"""The one path every update takes, the node's own and its peers': verify, validate, weigh, apply.

Updates arrive from untrusted peers: a bad one costs a counter increment and a log line,
never an exception. The weight is a pure function of the signed header, so every replica
weighs an update the same whatever order updates arrive in.

Beside it: its settings (merge.merge_config), the reasons a header is refused for
(merge.update_checks) and what it saves and hands to newcomers (merge.pipeline_state), both
mixins of UpdatePipeline; payload decoding (merge.payload); learner groups' updates
(merge.group_pipeline); what a learned proof of equivocation does (merge.settle).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from merge.codec_base import DecodesInto
from merge.codecs import CODECS
from merge.contribution import budgeted
from merge.correction import correct
from merge.cosign_ledger import parse_cosigned
from merge.envelope import SignedHeader, SignedUpdate, UpdateHeader
from merge.equivocation import Action, EquivocationBook, Proof, UpdateId, admitted_only
from merge.group_equivocation import GroupProof, GroupRun, MemberCheck, decode_proof
from merge.group_pipeline import GroupMerge, count_over_budget, count_rejection, floor_votes
from merge.group_update import GroupUpdate
from merge.handover import check_handover, settled_in
from merge.learners import LearnerFloor, credited_learners
from merge.merge_config import MergeConfig
from merge.payload import Rejected, decode_payload, raise_if
from merge.pipeline_state import PipelineState
from merge.rejections import RejectionLog
from merge.replica import Replica
from merge.replica_state import parse_applied
from merge.result import MergeResult
from merge.robust import RobustFilter, Verdict, round_share, substance
from merge.settle import settle
from merge.update_checks import MIN_PARAMS_NORM, UpdateChecks, learners_of, staleness_of
from merge.weighing_journal import WeighingJournal
from merge.weighting import staleness_weight, token_weight

logger = logging.getLogger(__name__)

# Reasons that an honest, up-to-date peer can produce; everything else suggests a bug or abuse.
_BENIGN_REASONS = frozenset({"duplicate", "replay", "too_stale", "wrong_run"})
_HEX64 = re.compile(r"[0-9a-f]{64}")


class UpdatePipeline(UpdateChecks, PipelineState):
    """Validates untrusted updates and applies the good ones to a replica; thread-safe.

    It is what dht/ calls through its merge port (dht.merge_port.MergePort, satisfied
    structurally: merge/ imports no dht), so a change to the methods that port names is a
    change to the network layer's interface."""

    def __init__(self, replica: Replica, config: MergeConfig, fingerprint: str) -> None:
        if not isinstance(fingerprint, str) or not _HEX64.fullmatch(fingerprint):
            raise ValueError("the run fingerprint must be 64 lowercase hex characters.")
        self.replica = replica
        self.config = config
        self.fingerprint = fingerprint
        self.rejections: collections.Counter[str] = collections.Counter()
        self.rejection_log = RejectionLog()
        """Rejections per peer and reason: this pipeline's and the swarm's (shared with it)."""
        self.num_merged = 0
        self._stats_lock = threading.Lock()
        self.robust = RobustFilter(config.robust)
        # One per fragment: norms and momenta of different fragments are not comparable.
        self._robust = [self.robust] + [
            RobustFilter(config.robust) for _ in range(1, replica.num_fragments)
        ]
        self.admit: Callable[[str], bool] | None = None
        """Permissioned runs: whether an author may contribute (None: anyone may)."""
        self.clock: Callable[[], float] = time.time
        self.learner_floor = LearnerFloor()
        """A floor under each update's signed learner count, from the recent applied updates'
        authors and claims (merge.learners): a low claim cannot buy a whole outer step."""
        self.ledger = self._new_ledger()
        """Each author's contribution budget and track record (merge.contribution)."""
        self.equivocation = EquivocationBook()
        """The signed header applied under each recent id (a second payload under it is
        equivocation) and the proofs this replica knows (merge.equivocation)."""
        self._scratch: torch.Tensor | None = None
        """The decode buffer reused across updates by codecs that decode into one (bf16)."""
        self._scratch_lock = threading.Lock()
        self.run_id: str | None = None
        """The run id learner groups' updates must name (their members sign it; None: not
        checked). Set by the node when groups are on."""
        self.group_run: GroupRun | None = None
        """What a proof of a group's equivocation is checked against (`enable_groups`; None:
        group proofs are refused)."""
        self.groups = GroupMerge(self)
        """Learner groups' updates (merge.group_pipeline)."""
        self.weighing = WeighingJournal()
        """The mutations of what weighs later updates, so that a superseded group variant's
        can be taken back (merge.weighing_journal); attached where groups are on."""

    def enable_groups(self, run_id: str, members_of: MemberCheck) -> None:
        """Learner groups are on: their updates name `run_id`, and `members_of(group key)`
        says who belongs to a group (dht.grouping.member_check), what their proofs of
        equivocation are checked by (merge.group_equivocation), persisted ones included."""
        self.run_id, self.group_run = run_id, GroupRun(run_id, members_of)
        self.equivocation.decode = functools.partial(decode_proof, run=self.group_run)
        self.attach_weighing()

    def adopt(self, state: dict[str, Any]) -> None:
        """Loads a donor's transfer_state in place of this replica and what judged its
        updates, all or nothing (ValueError, nothing changed). The merge state is checked
        against the replica it came with (merge.handover); a state without one (a donor of an
        earlier version) leaves this pipeline's as it is, and proofs that do not check out
        are dropped. The first-seen headers go: they named variants of the replaced replica."""
        params = state.get("params")
        if not isinstance(params, torch.Tensor) or not params.is_floating_point():
            raise ValueError("replica state must hold float params.")
        applied = parse_applied(state.get("applied"))
        merge = state.get("merge")
        if merge is not None:
            params_norm = float(torch.linalg.vector_norm(params, dtype=torch.float64))
            cap = self.config.max_update_norm_ratio * max(params_norm, MIN_PARAMS_NORM)
            # On the state as sent: the floor's loader would cut an overlong window silently.
            cosigned = parse_cosigned(state.get("cosigned"), applied)
            window = self.learner_floor.window
            check_handover(merge, applied, norm_cap=cap, window=window, cosigned=cosigned)
            staged = UpdatePipeline(self.replica, self.config, self.fingerprint)
            staged.load_state_dict(merge)  # the formats; raises before anything changed
        decode = self.equivocation.decode
        if self.admit is not None:  # a permissioned run: no proof of keys off its list
            decode = admitted_only(decode, self.admit)
        book = EquivocationBook(decode)
        proofs = state.get("equivocation")
        if isinstance(proofs, dict):
            proofs = {
                **proofs,
                "settled": settled_in(proofs.get("settled"), applied),
                "awaiting": settled_in(proofs.get("awaiting"), applied),
            }
            book.load_state_dict(proofs, self.fingerprint)
        with self.replica.lock:
            self.replica.load_state_dict(state)  # validates before it changes anything
            if merge is not None:
                self.load_state_dict(staged.state_dict())
            self.attach_weighing()  # journaled from the adopted state on
            self.equivocation = book

    def weight_of(self, header: UpdateHeader, learners: int | None = None) -> float:
        """The update's weight: staleness weight times token weight, from the header (and the
        learner count it is sized by, its signed one unless given).

        The outer step applies it as 1/learners of a round (see merge.outer), so a round of
        the swarm's updates makes one outer step whatever the swarm's size.
        """
        learners = learners_of(header) if learners is None else learners
        staleness = staleness_weight(self.config.staleness, staleness_of(header), learners)
        return staleness * token_weight(self.config.token_weight, header.tokens)

    def submit(self, update: SignedUpdate) -> MergeResult:
        """Verifies, validates, weighs and applies one update; never raises for bad input."""
        header = update.header
        try:
            weight, blocks_corrected, robust, learners = self._merge(update)
        except Rejected as rejected:
            return self._reject(header, rejected.reason)
        with self._stats_lock:
            self.num_merged += 1
        logger.debug("merged %s#%d with weight %.4g", header.author, header.seq, weight)
        return MergeResult(
            True, header.author, header.seq, staleness_of(header), weight, None,
            learners, blocks_corrected, robust, header.inner_steps,
        )  # fmt: skip

    def submit_group(self, update: GroupUpdate, in_group: Callable[[str], bool]) -> MergeResult:
        """A learner group's update, applied as one unit under its group key as author
        (merge.group_pipeline). ``in_group``: whether a peer id is a member of the update's
        group (dht.grouping). Never raises for bad input."""
        return self.groups.submit(update, in_group)

    def _merge(self, update: SignedUpdate) -> tuple[float, int, str | None, int]:
        header = update.header
        raise_if(self.check_header(update.signed_header))
        with self._decode_buffer(header.codec, header.numel) as out:
            pseudo_gradient, update_norm = decode_payload(update, out)
            return self._apply(update.signed_header, pseudo_gradient, update_norm)

    @contextlib.contextmanager
    def _decode_buffer(self, codec: str, numel: int) -> Iterator[torch.Tensor | None]:
        """The reused decode buffer (its first ``numel`` elements) while it is free and the
        codec decodes into one; None otherwise (the codec allocates). ``numel`` was checked
        against the replica's (check_header), so the buffer never outgrows the model."""
        if not isinstance(CODECS[codec], DecodesInto) or not self._scratch_lock.acquire(
            blocking=False
        ):
            yield None
            return
        try:
            if self._scratch is None or self._scratch.numel() < numel:
                self._scratch = torch.empty(max(numel, self.replica.numel), dtype=torch.float32)
            yield self._scratch[:numel]
        finally:
            self._scratch_lock.release()

    def _apply(
        self, signed: SignedHeader, pseudo_gradient: torch.Tensor, update_norm: float
    ) -> tuple[float, int, str | None, int]:
        header = signed.header
        with self.replica.lock:
            raise_if(self._trust_reason(header) or self._novelty_reason(header))
            author, established = header.author, self._credited()
            # Sized by the floor with fresh keys as one cohort (in a swarm's first rounds too:
            # 40 Sybils claiming 1,024 must not size the founders' updates as 1/43 of a round).
            claim = learners_of(header)
            voters, cohort = self.floor_votes()
            learners = self.learner_floor.effective(
                author, claim, voters, cohort, header.created_at
            )
            weight = self.weight_of(header, learners)
            raise_if(self._norm_reason(update_norm))
            outer = self.replica.outer_for(header.fragment)  # a fragment's: its own momentum
            momentum = outer.momentum_buffer
            staleness = staleness_of(header)
            corrected = correct(self.config.correction, pseudo_gradient, staleness, momentum)
            # Judged after the staleness correction: what remains hostile once an honest stale
            # update's conflict with the momentum has been corrected is clipped or zeroed.
            unchanged = corrected.pseudo_gradient is pseudo_gradient
            norm = update_norm if unchanged else None
            direction = outer.momentum_parts()
            robust = self._robust[header.fragment or 0]
            fresh = established is not None and not self.ledger.is_established(author)
            # A flush holds the residual of the rounds since its author's last flush: its
            # centered-clipping radius is theirs together (merge.robust, `spans`).
            spans = robust.spans(author) if header.flush else 1
            verdict = robust.judge(
                corrected.pseudo_gradient, direction, norm, voters=established, fresh=fresh,
                spans=spans,
            )  # fmt: skip
            # A robust verdict never refuses the id: replicas judge against their own recent
            # history, so a refusal on one and an acceptance on another would leave their
            # applied sets apart for good. The id is applied everywhere; what a verdict
            # removes is the update's contribution (clipped, recentered or zeroed).
            weight *= self._robust_scale(header, verdict)
            allowance = self._allowance(header, learners)
            # Stepped by the share let through, and none for zeros (robust.round_share: a flood
            # of zeros let through at the budget's rate folded the momentum several times per
            # honest update: bench.attack zero_flood 1.4-2.7x); a short honest round keeps its
            # whole share. Progress (what staleness counts) by its substance: a flood of zeros
            # does not make honest rounds stale.
            worth = substance(verdict)
            share = allowance * round_share(verdict)
            stepped, weight = budgeted(learners, weight, share, self.config.max_learners)
            clipped = robust.clipped(corrected.pseudo_gradient, direction, verdict)
            norm = norm if clipped is corrected.pseudo_gradient else None
            self.replica.apply(
                header, clipped, weight, norm, learners=stepped, credited=allowance * worth
            )
            # Only an update that moved the replica enters the windows the reference norm and
            # the learner floor are computed from: zeros, and what an author's budget or the
            # robust checks cut to nothing, take no share of them, so a flood of valid zero
            # updates neither drags the reference down (recorded at reference / k, an author
            # of zeros beside one other settled it at a quarter of the honest norm) nor pushes
            # the honest claims out of the floor's window (bench.attack zero_flood: 4 zeros a
            # second filled it, the other honest author was no longer among the latest
            # authors (node.network_swarm.live_learners) nor voting, so nodes claimed and
            # were sized by 1 learner, whole outer steps: 1.42x the clean loss).
            moved = weight > 0
            if moved:  # clamped into a band around the reference
                robust.record(verdict, author, flush=header.flush)
            if header.flush:  # its residual is sent: the next flush spans the rounds after
                robust.flushed(author)
            # A claim beyond the authors seen earns record in proportion (a low claim of
            # another author does not lower it, as a floor over everyone's claims would), and
            # so does an update of less substance than the reference (zeros earn none).
            evidence = self.learner_floor.num_authors(author) / claim * worth
            self.ledger.applied(author, learners, allowance, header.created_at, evidence)
            if moved:
                self.learner_floor.applied(author, learners_of(header), header.created_at)
            self.equivocation.first_seen(signed, weight, stepped)
        # Reported as sized by `learners`: weight / learners is the share of a round it moved.
        return weight * learners / stepped, corrected.blocks_corrected, verdict.reason, learners

    def floor_votes(self) -> tuple[Callable[[str], bool], bool]:
        """Whose learner claims vote on the floor on their own, and whether the fresh keys
        vote together as one (merge.learners), for solo and group updates alike
        (merge.group_pipeline.floor_votes: a group key by its co-signers' records). Called
        under the replica lock."""
        return floor_votes(self.ledger, self.replica.cosigned.cosigners)

    def _credited(self) -> Callable[[str], bool] | None:
        """Whose learner claims and robust votes count: the authors with a track record, or
        everyone (None) while no author has one (a swarm's first updates)."""
        return self.ledger.is_established if self.ledger.any_established() else None

    def is_fresh_author(self, author: str) -> bool:
        """Without a track record here: not counted on its own (ContributionLedger)."""
        with self.replica.lock:
            return not self.ledger.individually_counted()(author)

    def credited_learners(self, peers: set[str]) -> int:
        """How many learners live contributing `peers` count as (merge.learners): those
        with a track record each (ContributionLedger.individually_counted); fresh keys as one
        while no author is established, after only once one has a record of substance."""
        with self.replica.lock:
            ledger = self.ledger
            cohort = ledger.has_substance if ledger.any_established() else None
            return credited_learners(peers, ledger.individually_counted(), cohort)

    def _allowance(self, header: UpdateHeader, learners: int) -> float:
        """The share of the update its author's contribution budget lets through, counted."""
        allowance = self.ledger.allowance(header.author, learners, header.created_at)
        count_over_budget(self, header, allowance)
        return allowance

    def evidence(self, signed: SignedHeader) -> Proof | None:
        """The proof of equivocation that `signed` makes with the variant applied here."""
        with self.replica.lock:
            return self.equivocation.conflict(signed)

    def learn_proof(
        self, proof: Proof, applied_update: Callable[[UpdateHeader], SignedUpdate | None]
    ) -> Action:
        """Settles a proven equivocation the same way on every replica: the id stays (or is
        now) applied and contributes nothing. `applied_update` gives the variant this replica
        applied (its retained copy), whose outer step is withdrawn."""
        uid = proof.update_id
        with self.replica.lock:
            action = settle(
                self.equivocation, self.replica, proof,
                recorded=lambda: proof.first.header,
                withdraw=lambda: self._withdraw(uid, applied_update),
            )  # fmt: skip
        if action != "none":
            count_rejection(self, uid[0], "equivocation")
            logger.warning("update %s#%d: equivocation proven; %s", uid[0], uid[1], action)
        return action

    def group_evidence(self, update: GroupUpdate) -> GroupProof | None:
        """The proof of a group's equivocation `update` makes with the variant applied here."""
        return self.groups.evidence(update)

    def learn_group_proof(
        self, proof: GroupProof, applied_group: Callable[[UpdateId], GroupUpdate | None]
    ) -> Action:
        """Settles a group's proven equivocation the same way on every replica
        (merge.group_pipeline.GroupMerge.learn_proof)."""
        return self.groups.learn_proof(proof, applied_group)

    def _withdraw(
        self, uid: tuple[str, int], applied_update: Callable[[UpdateHeader], SignedUpdate | None]
    ) -> None:
        entry = self.equivocation.applied_variant(uid)
        if entry is None:
            logger.warning("update %s#%d: applied too long ago to withdraw", *uid)
            return
        header, weight, learners = entry[0].header, entry[1], entry[2]
        update = applied_update(header) if weight != 0 else None
        if update is None or update.header.payload_digest != header.payload_digest:
            if weight != 0:
                logger.warning("update %s#%d: its applied payload is gone; kept", *uid)
            return
        pseudo_gradient, _ = decode_payload(update)
        self.replica.withdraw(header, pseudo_gradient, weight, learners)

    def _robust_scale(self, header: UpdateHeader, verdict: Verdict) -> float:
        """The share of the update's contribution the robust checks let through, in [0, 1]."""
        if verdict.reason is None:
            return 1.0
        count_rejection(self, header.author, verdict.reason)
        logger.warning(
            "%s#%d: %s (norm %.4g, median %s, cosine %s); its contribution is %s",
            header.author,
            header.seq,
            verdict.reason,
            verdict.norm,
            verdict.median_norm,
            verdict.cosine,
            "zeroed" if verdict.reason == "against_momentum" else "clipped",
        )
        if verdict.reason == "against_momentum":
            return 0.0
        return 1.0 if verdict.recenter is not None else verdict.scale  # recentered: in the tensor

    def _reject(self, header: UpdateHeader, reason: str) -> MergeResult:
        count_rejection(self, header.author, reason)
        level = logging.INFO if reason in _BENIGN_REASONS else logging.WARNING
        logger.log(level, "rejected update %s#%d: %s", header.author, header.seq, reason)
        return MergeResult(False, header.author, header.seq, staleness_of(header), 0.0, reason)
