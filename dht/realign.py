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

The settle: once this replica's applied set holds at one digest for a period (the swarm
stopped publishing, or pauses between bursts), the donor is `settle_donor` over the
participants seen there last: a function of their sketches at that digest and their records
alone, so every replica seen there picks one donor whatever it saw before and in whatever
order (choose_donor reads each pair's latest shared digest, which differs per node: at
bench.scale N = 8, 10 realignments went to 6 donors and drift 0.0048 stayed). A replica
apart from it beyond the threshold realigns after a period, as before; one apart beyond
float rounding (`settle_tolerance`, 1e-6) after `settle_periods` (5): then every live
replica holds one point, drift 0.0. They settle two at a time (`settle_wave`: the donor
serves two downloads at once and refuses more), ranked alike by peer id. The cooldown, the
cap, the records and the state check hold for the settle as for any realignment.

Why 0.02: honest replicas with one applied set differ by rounding and by the few robust
verdicts taken near a threshold (bench.scale --sizes 4: final drift 0.0043; the sketch's
sampling noise is of that order); one step sized by the wrong learner count leaves ~0.13.
0.02 is ~5x the honest noise and under the 0.05 both the state check (MAX_DRIFT) and the
swarm test promise.

The gap: an update this node declared lost (no live peer held it for the gap wait,
dht.catchup) that a live peer applied and no longer holds can never be fetched, so this
replica's applied set never equals the swarm's and neither the drift nor the settle (both
at shared digests) can act: at bench.scale N = 16, 15 replicas ended at one applied set of
204 and one at 201, three updates short, after a stall of its own. Summaries name such
updates (`note_gap`); once one has been named for `gap_periods`, this node downloads the
state of a peer that named one (the heaviest record first), under the realignment's cooldown
and cap, and its retained updates are merged again after it.

Pure: no network, no clock (the caller passes `now`); dht.swarm drives it once a period.
After a donor's state is adopted, `merge_retained` merges again what this node had applied
and the donor had not (its own last updates among them: no peer may hold them yet).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from dht.catchup import AppliedSet
from dht.gossip_groups import is_group_key, parse_fetched
from dht.grouping import member_check
from dht.heartbeat import Heartbeat
from dht.merge_port import MergePort
from dht.retention import RetainedUpdates
from dht.vouchers import Reports
from merge.envelope import EnvelopeError, SignedUpdate
from merge.result import MergeResult
from merge.sketch import relative_distance

logger = logging.getLogger(__name__)
THRESHOLD = 0.02
"""Relative distance between settled points at one applied digest above which a replica
realigns (see the module's doc)."""
SETTLE_TOLERANCE = 1e-6
"""Relative distance under which two settled points at one held digest are one (float
rounding): above it, a replica settles to the donor once the digest held long enough."""


@dataclass(frozen=True, kw_only=True)
class RealignConfig:
    period_s: float
    """The heartbeat period: the two sightings of a drift are at least this far apart."""
    threshold: float = THRESHOLD
    """Distance at a shared digest above which this node realigns to the donor, and within
    which one participant supports another."""
    cooldown_s: float = 60.0
    """Least time between two realignment attempts (successful or not)."""
    max_attempts: int = 3
    """Realignment attempts per `attempts_window_s`, whatever they gave."""
    attempts_window_s: float = 1800.0
    settle_tolerance: float = SETTLE_TOLERANCE
    """At a held digest, distance to the settle donor above which this node realigns."""
    settle_periods: float = 5.0
    """Periods this node's and the donor's sightings must hold together at one digest before
    a drift within the threshold is settled: a pause between bursts of updates is shorter,
    and each settle costs an attempt (the cap) and a state download."""
    max_settles: int = 3
    """Settle attempts per `attempts_window_s`, besides `max_attempts`."""
    settle_cooldown_periods: float = 5.0
    """Least time, in periods, between any attempt and a settle attempt."""
    settle_wave: int = 2
    """Replicas that settle at once: a donor serves two downloads at a time and refuses more
    (dht.state_transfer), and a refused attempt waits out the cooldown."""
    settle_stagger_periods: float = 3.0
    """Periods each further wave of settling replicas waits (the ones apart from the donor
    in peer id order, `settle_wave` a wave: every replica there ranks them alike)."""
    gap_periods: float = 3.0
    """Periods an update lost here and applied by a peer that does not hold it must have been
    named by summaries before this node downloads a peer's state for it (another summary
    may still name a holder, which revives it: dht.catchup)."""
    horizon_periods: float = 20.0
    """Sightings older than this many periods are forgotten."""
    max_digests_per_peer: int = 16
    """Sightings kept per participant (its latest digests)."""
    max_participants: int = 32
    """Participants compared (the heaviest records first, then by peer id): bounds the work
    of a period to O(max_participants^2 x max_digests_per_peer) sketch distances."""

    def __post_init__(self) -> None:
        for name in (
            "period_s", "threshold", "settle_tolerance", "settle_periods", "cooldown_s",
            "attempts_window_s", "settle_wave", "max_settles", "settle_cooldown_periods",
            "gap_periods",
        ):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}.")
        for name in ("max_attempts", "max_digests_per_peer", "max_participants"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}.")

    @property
    def horizon_s(self) -> float:
        return self.horizon_periods * self.period_s


@dataclass(frozen=True)
class Sighting:
    """A participant's replica as one heartbeat showed it: its settled sketch at a digest."""

    digest: str
    sketch: tuple[float, ...]
    at: float
    """When this node first saw that participant at that digest."""
    last: float | None = None
    """When this node last saw it there (None: only at `at`)."""

    @property
    def until(self) -> float:
        return self.at if self.last is None else self.last


@dataclass(frozen=True)
class Realign:
    """Download `donor`'s state: this replica's settled point lay `distance` (relative) from
    the donor's at their latest shared applied digest."""

    donor: str
    distance: float
    settle: bool = False
    """Chosen at a held digest (settle_donor), the drift within the threshold."""
    gap: int = 0
    """Chosen for updates lost here that the donor applied (`note_gap`): how many it named."""


@dataclass
class _Participant:
    sightings: list[Sighting] = field(default_factory=list)
    num_realigned: int = 0
    serves_state: bool = True


def record_weights(heartbeats: list[Heartbeat], applied_here: Mapping[str, int]) -> dict[str, int]:
    """Per participant, its applied track record (dht.vouchers.Reports: its updates another
    live peer reports applied, at most its own latest seq), capped by how many of its updates
    this replica applied (`applied_here`): a clique of fresh keys vouching for each other
    weighs nothing here. Only positive weights."""
    reports = Reports(heartbeats)
    weights: dict[str, int] = {}
    for h in heartbeats:
        weight = min(reports.record(h.peer_id), applied_here.get(h.peer_id, 0))
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


def settle_donor(
    sketches: Mapping[str, tuple[float, ...]],
    weights: Mapping[str, int],
    eligible: Iterable[str],
) -> str | None:
    """At one held digest (`sketches`: each participant's settled sketch there), the
    eligible participant with a record whose sketch lies nearest the others', weighed by
    their records (the least sum of record x Euclidean distance: a weighted medoid), ties to
    the smallest peer id; None: none eligible.

    A function of the sketches at that digest and the records alone, not of when or in
    which order they were seen, so every replica that sees one swarm held there picks one
    donor (choose_donor reads each pair's latest *shared* digest, which depends on what
    each node saw before). It stays the donor while the others copy it: a replica that
    adopts its state moves to its point, which lowers the donor's sum by as much as that
    replica's distance to it and no other's by more (the triangle inequality); a replica
    that copied it sits at its point, ties and is, if chosen, the same state. A hostile
    participant with a record moves the sums by at most its weight times its move: it can
    swing the choice only among points that are close to even, and each swing costs its
    victims an attempt under the cooldown and the cap."""
    score = {
        p: sum(
            weights[q] * _euclidean(sketch, other)
            for q, other in sorted(sketches.items())
            if q != p and weights.get(q, 0) > 0
        )
        for p, sketch in sketches.items()
    }
    candidates = sorted(p for p in eligible if weights.get(p, 0) > 0 and p in score)
    if not candidates:
        return None
    return min(candidates, key=lambda p: (score[p], p))


def _euclidean(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    if len(a) != len(b):
        return math.inf
    distance = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b, strict=True)))
    return distance if math.isfinite(distance) else math.inf


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


def held_distance(mine: list[Sighting], theirs: list[Sighting]) -> tuple[float, float] | None:
    """(distance, seconds both were seen there together) at the digest both were seen at
    last, while both still were: once updates stop (the swarm lingers, or publishes slowly)
    the applied set stays at one digest, and two digests a period apart never come, so a
    drift that holds there is judged by how long it held (before, such a replica never
    realigned: bench.scale ended at N = 8 with one applied set and drift 0.22). None: no
    such digest, or sketches that cannot be compared."""
    if not mine or not theirs:
        return None
    own, other = mine[-1], theirs[-1]
    if own.digest != other.digest:
        return None
    distance = relative_distance(list(own.sketch), list(other.sketch))
    if distance is None:
        return None
    return distance, min(own.until, other.until) - max(own.at, other.at)


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


class RealignPolicy:
    """Sightings of the participants' settled points and this node's realignment attempts;
    not thread-safe (the swarm's loop owns it)."""

    def __init__(self, config: RealignConfig, self_id: str) -> None:
        self.config = config
        self.self_id = self_id
        self._participants: dict[str, _Participant] = {}
        self._weights: dict[str, int] = {}
        self._attempts: list[tuple[float, bool]] = []
        """(when, whether a settle) of the attempts in the window."""
        self.num_realigned = 0
        """Realignments that loaded a donor's state."""
        self.num_refused = 0
        """Realignment attempts that loaded nothing (a refused or failed download)."""
        self._gaps: dict[str, tuple[float, float, int]] = {}
        """Per peer whose last summary named updates lost here that it applied and does not
        hold: (first named, last named, how many)."""

    # ---- what the node sees ----------------------------------------------------------------

    def observe(self, own: Heartbeat, peers: list[Heartbeat], now: float) -> None:
        """This node's heartbeat and its live peers' (the latest of each), seen at `now`.
        Peers not among them left: what was seen of them goes."""
        applied_here = dict(own.merged_by_author)
        # Only authors this replica applied updates of can weigh anything: a thousand Sybil
        # heartbeats cost nothing here (nor do their reports raise anyone's record).
        alive = [own, *(h for h in peers if h.peer_id != own.peer_id and h.peer_id in applied_here)]
        weights = record_weights(alive, applied_here)
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
        participant = self._participants.setdefault(h.peer_id, _Participant())
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

    def note_gap(self, peer_id: str, num_unreachable: int, now: float) -> None:
        """`peer_id`'s summary named `num_unreachable` updates it applied that this node
        declared lost and that it does not hold (dht.catchup's Learned); 0 clears it."""
        if num_unreachable <= 0 or peer_id == self.self_id:
            self._gaps.pop(peer_id, None)
            return
        first = self._gaps[peer_id][0] if peer_id in self._gaps else now
        self._gaps[peer_id] = (first, now, num_unreachable)
        if len(self._gaps) > self.config.max_participants:  # the longest unnamed goes
            del self._gaps[min(self._gaps, key=lambda p: (self._gaps[p][1], p))]

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
        decision = self._gap(now) or self._candidate()
        if decision is None or not self._may_attempt(now, settle=decision.settle):
            return None
        return decision

    def _candidate(self) -> Realign | None:
        mine = self._participants.get(self.self_id)
        if mine is None or not mine.sightings:
            return None
        if mine.sightings[-1].until - mine.sightings[-1].at >= self.config.period_s:
            return self._settle(mine.sightings)  # the applied set holds at one digest
        donor = self.donor()
        if donor is None or donor == self.self_id:
            return None
        theirs = self._participants[donor].sightings
        threshold, period = self.config.threshold, self.config.period_s
        shared = shared_distances(mine.sightings, theirs)
        if len(shared) < 2:
            return None
        (earlier, seen_first), (latest, seen_last) = shared[-2], shared[-1]
        if earlier <= threshold or latest <= threshold:
            return None
        if seen_last - seen_first < period:
            return None
        return Realign(donor, latest)

    def _gap(self, now: float) -> Realign | None:
        """Updates lost here that live peers with a record applied and no longer hold, named
        for `gap_periods` or more: the state of the one among them with the heaviest record
        (then the smallest peer id) that serves it."""
        period = self.config.period_s
        named = {
            p: gap
            for p, gap in self._gaps.items()
            if self._weights.get(p, 0) > 0
            and p in self._participants
            and self._participants[p].serves_state
            and now - gap[1] <= self.config.horizon_s
        }
        if not named or now - min(g[0] for g in named.values()) < self.config.gap_periods * period:
            return None
        donor = min(named, key=lambda p: (-self._weights[p], p))
        return Realign(donor, 0.0, gap=named[donor][2])

    def settle_donor(self) -> str | None:
        """At the digest this node's replica was seen at last: the participant every replica
        seen there settles to (settle_donor over the participants seen there last)."""
        return self._settle_donor(self._latest_at_own_digest())

    def _settle_donor(self, there: dict[str, tuple[float, ...]]) -> str | None:
        eligible = [p for p in there if self._participants[p].serves_state]
        return settle_donor(there, self._weights, eligible)

    def _latest_at_own_digest(self) -> dict[str, tuple[float, ...]]:
        """The sketches of the participants seen last at this node's latest digest."""
        mine = self._participants.get(self.self_id)
        if mine is None or not mine.sightings:
            return {}
        own = mine.sightings[-1]
        return {
            p: v.sightings[-1].sketch
            for p, v in self._participants.items()
            if v.sightings
            and v.sightings[-1].digest == own.digest
            and len(v.sightings[-1].sketch) == len(own.sketch)
        }

    def _settle(self, mine: list[Sighting]) -> Realign | None:
        """This node's replica held at one digest for a period: realign to the settle donor
        when apart from it beyond the threshold for a period (as at moving digests), or
        beyond float rounding for `settle_periods`."""
        there = self._latest_at_own_digest()
        donor = self._settle_donor(there)
        if donor is None or donor == self.self_id:
            return None
        held = held_distance(mine, self._participants[donor].sightings)
        if held is None:
            return None
        distance, together = held
        period = self.config.period_s
        if distance > self.config.threshold and together >= period:
            return Realign(donor, distance)  # one applied set, apart for a period or more
        if distance <= self.config.settle_tolerance:
            return None
        to_donor = self._to_donor(there, donor)
        sources = self._sources(donor, to_donor)
        rank, wave = (
            self._settle_rank(donor, to_donor),
            self.config.settle_wave * len(sources),
        )
        wait = self.config.settle_periods + (rank // wave) * self.config.settle_stagger_periods
        if together >= wait * period:
            source = sources[(rank // self.config.settle_wave) % len(sources)]
            return Realign(source, distance, settle=True)
        return None

    def _to_donor(self, there: dict[str, tuple[float, ...]], donor: str) -> dict[str, float]:
        """Each participant's distance to `donor`'s point (those that can be compared)."""
        point = list(there[donor])
        return {
            p: d
            for p, sketch in there.items()
            if (d := relative_distance(list(sketch), point)) is not None
        }

    def _sources(self, donor: str, to_donor: dict[str, float]) -> list[str]:
        """Who serves the donor's state: the donor and the participants at its point (those
        that settled to it: the same state), with a record and serving state, the latest to
        get there first (a donor serves two downloads at once, dht.state_parts: each
        replica that settles adds two slots). Which of them serves whom changes no end
        point, so it need not be alike on every replica."""
        clones = [
            p
            for p, d in to_donor.items()
            if d <= self.config.settle_tolerance
            and p not in (donor, self.self_id)
            and self._weights.get(p, 0) > 0
            and self._participants[p].serves_state
        ]
        arrived = {p: self._participants[p].sightings[-1].at for p in clones}
        return [*sorted(clones, key=lambda p: (-arrived[p], p)), donor]

    def _settle_rank(self, donor: str, to_donor: dict[str, float]) -> int:
        """This node's rank among the replicas apart from the donor's point (by peer id;
        those that settled are at the donor's point and drop out)."""
        apart = sorted(
            p for p, d in to_donor.items() if p != donor and d > self.config.settle_tolerance
        )
        return apart.index(self.self_id) if self.self_id in apart else 0

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
