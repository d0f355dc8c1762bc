"""Parameter anti-entropy: when to download a peer's state because this replica's parameters
drifted from its peers' although they applied the same updates, and from whom.

Replicas that applied one set of updates should settle to one point (merge.sketch), but some
merge decisions depend on what a replica applied before (the learner floor at start-up,
robust verdicts near their thresholds: merge.robust), so one update can be weighed
differently on two replicas, for good (tests/swarm/test_swarm.py's three nodes: 0.13 of the
params' norm apart in one run of three). Repair of the applied set (dht.catchup) cannot see
that; this policy can: heartbeats carry (applied digest, settled sketch), and two sketches
at one digest measure how far two replicas drifted.

The donor is one choice every replica makes alike from the same heartbeats, so replicas
converge on one state and never chase each other: among the participants (this node and the
live peers with an applied track record here, `record_weights`), the one whose sketch lies
within `threshold` of the most record-weighted others at shared digests, ties to the
smallest peer id. A node realigns only when its own distance to that donor exceeded the
threshold at its two latest shared digests, seen at least a period apart, then waits out a
cooldown, and at most `max_attempts` per `attempts_window_s`: a hostile peer cannot make it
download state in a loop, and a key without a record (a fresh one) is never a donor and
supports nobody. The state itself still goes through the newcomer's checks
(dht.state_check).

The settle (at a digest held for a period) and the gap (updates lost here that a peer
applied and no longer holds) are in dht.realign_settle, mixed into the policy.

Why 0.02: honest replicas with one applied set differ by rounding and by the few robust
verdicts taken near a threshold (bench.scale --sizes 4: final drift 0.0043; the sketch's
sampling noise is of that order); one step sized by the wrong learner count leaves ~0.13.
0.02 is ~5x the honest noise and under the 0.05 both the state check (MAX_DRIFT) and the
swarm test promise.

Pure: no network, no clock (the caller passes `now`); dht.swarm drives it once a period.
After a donor's state is adopted, `merge_retained` merges again what this node had applied
and the donor had not (its own last updates among them: no peer may hold them yet).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace

from dht.catchup import AppliedSet
from dht.gossip_groups import is_group_key, parse_fetched
from dht.grouping import member_check
from dht.heartbeat import Heartbeat
from dht.merge_port import MergePort
from dht.realign_config import RealignConfig
from dht.realign_settle import Participant, Realign, SettleAndGap, Sighting
from dht.retention import RetainedUpdates
from dht.vouchers import Reports, group_record
from merge.envelope import EnvelopeError, SignedUpdate
from merge.result import MergeResult
from merge.sketch import relative_distance

logger = logging.getLogger(__name__)


def record_weights(
    heartbeats: list[Heartbeat],
    applied_here: Mapping[str, int],
    cosigned: Mapping[str, Mapping[str, int]] | None = None,
) -> dict[str, int]:
    """Per participant, its applied track record (dht.vouchers.Reports: its updates another
    live peer reports applied, at most its own latest seq), capped by how many of its updates
    this replica applied (`applied_here`), plus the learner groups' updates it co-signed
    (`cosigned`, per group key, merge.cosign_ledger: dht.vouchers.group_record): a clique of
    fresh keys vouching for each other weighs nothing here. Only positive weights."""
    reports = Reports(heartbeats)
    weights: dict[str, int] = {}
    for h in heartbeats:
        weight = min(reports.record(h.peer_id), applied_here.get(h.peer_id, 0))
        weight += group_record(reports, cosigned or {}, h.peer_id)
        if weight > 0:
            weights[h.peer_id] = weight
    return weights


def choose_donor(
    sightings: Mapping[str, list[Sighting]],
    weights: Mapping[str, int],
    eligible: Iterable[str],
    threshold: float,
) -> str | None:
    """The eligible participant whose sketch lies within `threshold` of the most weight of
    others at their latest shared digest, ties to the smallest peer id (None: none eligible).
    A function of its arguments alone: every node that sees the same sightings and weights
    picks the same donor."""
    closeness = latest_distances(sightings)
    support: dict[str, int] = {}
    for (a, b), (distance, _) in closeness.items():
        if distance <= threshold:
            support[a] = support.get(a, 0) + weights.get(b, 0)
            support[b] = support.get(b, 0) + weights.get(a, 0)
    candidates = sorted(p for p in eligible if weights.get(p, 0) > 0 and p in sightings)
    if not candidates:
        return None
    return min(candidates, key=lambda p: (-support.get(p, 0), p))


def shared_distances(mine: list[Sighting], theirs: list[Sighting]) -> list[tuple[float, float]]:
    """(distance, when the later of the two was seen) at each digest both sightings share,
    oldest first; pairs that cannot be compared are left out."""
    by_digest = {s.digest: s for s in theirs}
    found: list[tuple[float, float]] = []
    for own in mine:
        other = by_digest.get(own.digest)
        if other is None:
            continue
        distance = relative_distance(list(own.sketch), list(other.sketch))
        if distance is not None:
            found.append((distance, max(own.at, other.at)))
    return sorted(found, key=lambda pair: pair[1])


def latest_distances(
    sightings: Mapping[str, list[Sighting]],
) -> dict[tuple[str, str], tuple[float, float]]:
    """Per pair of participants (a < b) that shared a digest, the distance at the latest one
    and when it was seen."""
    found: dict[tuple[str, str], tuple[float, float]] = {}
    peers = sorted(sightings)
    for i, a in enumerate(peers):
        for b in peers[i + 1 :]:
            shared = shared_distances(sightings[a], sightings[b])
            if shared:
                found[(a, b)] = shared[-1]
    return found


class RealignPolicy(SettleAndGap):
    """Sightings of the participants' settled points and this node's realignment attempts;
    not thread-safe (the swarm's loop owns it)."""

    def __init__(self, config: RealignConfig, self_id: str) -> None:
        self.config = config
        self.self_id = self_id
        self._participants: dict[str, Participant] = {}
        self._weights: dict[str, int] = {}
        self._attempts: list[tuple[float, bool]] = []
        """(when, whether a settle) of the attempts in the window."""
        self.num_realigned = 0
        """Realignments that loaded a donor's state."""
        self.num_refused = 0
        """Realignment attempts that loaded nothing (a refused or failed download)."""
        self._gaps: dict[str, tuple[float, float, int]] = {}

    # ---- what the node sees ----------------------------------------------------------------

    def observe(
        self,
        own: Heartbeat,
        peers: list[Heartbeat],
        now: float,
        cosigned: Mapping[str, Mapping[str, int]] | None = None,
    ) -> None:
        """This node's heartbeat and its live peers' (the latest of each), seen at `now`;
        `cosigned`: this replica's co-signers of applied group updates (merge.cosign_ledger).
        Peers not among them left: what was seen of them goes."""
        applied_here, cosigned = dict(own.merged_by_author), cosigned or {}
        # Only authors (or co-signers) of updates this replica applied can weigh anything: a
        # thousand Sybil heartbeats cost nothing here (nor do their reports raise a record).
        credited = applied_here.keys() | cosigned.keys()
        alive = [own, *(h for h in peers if h.peer_id != own.peer_id and h.peer_id in credited)]
        weights = record_weights(alive, applied_here, cosigned)
        ranked = sorted(weights, key=lambda p: (-weights[p], p))[: self.config.max_participants]
        self._weights = {p: weights[p] for p in ranked}
        keep = {own.peer_id, *ranked}
        for peer_id in list(self._participants):
            if peer_id not in keep:
                del self._participants[peer_id]
        for peer_id in list(self._gaps):
            if peer_id not in keep:  # left, or no record here: names nothing
                del self._gaps[peer_id]
        for h in alive:
            if h.peer_id in keep:
                self._see(h, now)

    def _see(self, h: Heartbeat, now: float) -> None:
        participant = self._participants.setdefault(h.peer_id, Participant())
        if h.num_realigned != participant.num_realigned:  # a new lineage: the old one is moot
            participant.sightings.clear()
            participant.num_realigned = h.num_realigned
        participant.serves_state = h.serves_state
        horizon = now - self.config.horizon_s
        sightings = [s for s in participant.sightings if s.at >= horizon]
        if h.applied_digest and h.sketch:
            seen = Sighting(h.applied_digest, tuple(h.sketch), now)
            same = [s for s in sightings if s.digest == seen.digest]
            if not same:
                sightings.append(seen)
            elif same[0].sketch == seen.sketch:  # still there: how long it held counts
                sightings = [replace(s, last=now) if s is same[0] else s for s in sightings]
            else:  # another sketch at one digest (a resketch): it holds from now
                sightings = [seen if s is same[0] else s for s in sightings]
        participant.sightings = sightings[-self.config.max_digests_per_peer :]

    # ---- what the node does ----------------------------------------------------------------

    def donor(self) -> str | None:
        """The participant every replica realigns to (choose_donor), None when none is
        eligible (no participant with a track record here that serves its state)."""
        sightings = {p: v.sightings for p, v in self._participants.items()}
        eligible = [p for p, v in self._participants.items() if v.serves_state]
        return choose_donor(sightings, self._weights, eligible, self.config.threshold)

    def decide(self, now: float) -> Realign | None:
        """Realign now, and from whom, or None: this node is not the donor, drifted more than
        the threshold from it at their two latest shared digests, seen a period apart or more,
        and neither the cooldown nor the cap forbids it."""
        gap = self._gap(now)
        for decision in [gap] if gap is not None else self._candidates():
            if self._may_attempt(now, settle=decision.settle):
                return decision
        return None

    def _candidates(self) -> list[Realign]:
        mine = self._participants.get(self.self_id)
        if mine is None or not mine.sightings:
            return []
        if mine.sightings[-1].until - mine.sightings[-1].at >= self.config.period_s:
            return self._settle(mine.sightings)  # the applied set holds at one digest
        drift = self._drift(mine.sightings)
        return [] if drift is None else [drift]

    def _drift(self, mine: list[Sighting]) -> Realign | None:
        """Apart from the donor beyond the threshold at the two latest shared digests."""
        donor = self.donor()
        if donor is None or donor == self.self_id:
            return None
        theirs = self._participants[donor].sightings
        threshold, period = self.config.threshold, self.config.period_s
        shared = shared_distances(mine, theirs)
        if len(shared) < 2:
            return None
        (earlier, seen_first), (latest, seen_last) = shared[-2], shared[-1]
        if earlier <= threshold or latest <= threshold:
            return None
        if seen_last - seen_first < period:
            return None
        return Realign(donor, latest)

    def started(self, now: float, *, settle: bool = False) -> None:
        """An attempt began: the cooldown and the cap count from `now`."""
        self._attempts.append((now, settle))

    def finished(self, *, loaded: bool) -> None:
        """The attempt loaded the donor's state (this replica's sightings are moot: a new
        lineage) or loaded nothing."""
        if loaded:
            self.num_realigned += 1
            self._participants.pop(self.self_id, None)
            self._gaps.clear()  # a new applied set: the next summaries say what is left
        else:
            self.num_refused += 1

    def _may_attempt(self, now: float, *, settle: bool) -> bool:
        """A realignment: `max_attempts` per window, `cooldown_s` after any attempt. A settle:
        `max_settles` per window besides (realignments while training must not spend the
        settle's), `settle_cooldown_periods` after any attempt (a refused one: the donor was
        busy serving two others)."""
        config = self.config
        window = now - config.attempts_window_s
        self._attempts = [a for a in self._attempts if a[0] > window]
        kind = [t for t, was_settle in self._attempts if was_settle == settle]
        cap = config.max_settles if settle else config.max_attempts
        if len(kind) >= cap:
            return False
        cooldown = config.settle_cooldown_periods * config.period_s if settle else config.cooldown_s
        return not self._attempts or now - self._attempts[-1][0] >= cooldown


def lacking_retained(retained: RetainedUpdates, applied: AppliedSet) -> list[tuple[str, int]]:
    """The retained updates (each applied here once: dht.gossip retains what it merged and
    what this node published) that the replica now lacks, lowest seq first."""
    lacking = [uid for uid in retained.ids() if not applied.has_applied(*uid)]
    return sorted(lacking, key=lambda uid: (uid[1], uid[0]))


def merge_retained(retained: RetainedUpdates, merge: MergePort) -> list[MergeResult]:
    """Merge each retained update the replica lacks through the one path every update takes
    (verify, validate, weigh, apply; a learner group's update through `submit_group`, every
    member's signature and co-signature checked), lowest seq first; what became of each.
    Call it on the merge's thread, once a donor's state was adopted."""
    results: list[MergeResult] = []
    for uid in lacking_retained(retained, merge.replica):
        data = retained.get(uid)
        if data is None or merge.replica.has_applied(*uid):  # evicted, or merged meanwhile
            continue
        if is_group_key(uid[0]):  # a learner group's update: merged as one unit, as fetched
            group = parse_fetched(data, uid, merge.replica.numel)
            if isinstance(group, str):  # it was checked when it came: never expected
                logger.warning("retained group update %s#%d does not parse: %s", *uid, group)
                continue
            in_group = member_check(group.head.run_id, uid[0])  # the merge checks the run id
            results.append(merge.submit_group(group, in_group))
            continue
        try:
            update = SignedUpdate.from_bytes(data)
        except EnvelopeError as exc:  # it was checked when it came: never expected
            logger.warning("retained update %s#%d does not parse: %s", *uid, exc)
            continue
        results.append(merge.submit(update))
    return results
