"""The settle and the gap: the two realignment decisions that do not read drift between two
moving digests (dht.realign's seam; the policy, RealignPolicy, mixes them in).

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

The gap: an update this node declared lost or waits a state for (no live peer held it for
the gap wait, dht.catchup) that a live peer applied and no longer holds can never be
fetched, so this replica's applied set never equals the swarm's and neither the drift nor
the settle (both at shared digests) can act: at bench.scale N = 16, 15 replicas ended at one
applied set of 204 and one at 201, three updates short, after a stall of its own. Summaries
name such updates (`note_gap`); once one has been named for `gap_periods`, this node
downloads the state of a peer that named one (the heaviest record first), under the
realignment's cooldown and cap, and its retained updates are merged again after it.

Pure: no network, no clock (the caller passes `now`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from dht.realign_config import RealignConfig
from merge.sketch import relative_distance


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
    group: bool = False
    """Chosen by dht.realign_class: this member was left out of its group's fetch round, and
    the donor is a member of the class that round ran among."""


@dataclass
class Participant:
    sightings: list[Sighting] = field(default_factory=list)
    num_realigned: int = 0
    serves_state: bool = True


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


class SettleAndGap:
    """RealignPolicy's settle and gap decisions, over the policy's own state (below); not
    thread-safe (the swarm's loop owns the policy)."""

    config: RealignConfig
    self_id: str
    _participants: dict[str, Participant]
    _weights: dict[str, int]
    _gaps: dict[str, tuple[float, float, int]]
    """Per peer whose last summary named updates lost here that it applied and does not
    hold: (first named, last named, how many)."""

    def note_gap(self, peer_id: str, num_unreachable: int, now: float) -> None:
        """`peer_id`'s summary named `num_unreachable` updates it applied that this node
        declared lost or waits a state for and that it does not hold (dht.catchup's Learned);
        0 clears it."""
        if num_unreachable <= 0 or peer_id == self.self_id:
            self._gaps.pop(peer_id, None)
            return
        first = self._gaps[peer_id][0] if peer_id in self._gaps else now
        self._gaps[peer_id] = (first, now, num_unreachable)
        if len(self._gaps) > self.config.max_participants:  # the longest unnamed goes
            del self._gaps[min(self._gaps, key=lambda p: (self._gaps[p][1], p))]

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

    def _settle(self, mine: list[Sighting]) -> list[Realign]:
        """This node's replica held at one digest for a period: realign to the settle donor
        when apart from it beyond the threshold for a period (as at moving digests), and
        settle to it (in waves, under the settle's own cap) when apart beyond float rounding
        for `settle_periods`; the candidates, the one to try first first (the caller keeps
        the first the cooldown and the caps allow).

        Once the settle is due it goes first, and a drift beyond the threshold settles too:
        before, such a replica realigned only under the realignments' cap, which those
        while training share (3 per 30 min), so one that had realigned while training and
        then met a refusal or a busy donor at the held digest never tried again (bench.scale
        --sizes 16 ended with one applied set 1.2 apart, settle_s None)."""
        there = self._latest_at_own_digest()
        donor = self._settle_donor(there)
        if donor is None or donor == self.self_id:
            return []
        held = held_distance(mine, self._participants[donor].sightings)
        if held is None:
            return []
        distance, together = held
        period = self.config.period_s
        fast = []
        if distance > self.config.threshold and together >= period:
            fast = [Realign(donor, distance)]  # one applied set, apart for a period or more
        if distance <= self.config.settle_tolerance:
            return fast
        to_donor = self._to_donor(there, donor)
        sources = self._sources(donor, to_donor)
        rank, wave = (
            self._settle_rank(donor, to_donor),
            self.config.settle_wave * len(sources),
        )
        wait = self.config.settle_periods + (rank // wave) * self.config.settle_stagger_periods
        if together >= wait * period:
            source = sources[(rank // self.config.settle_wave) % len(sources)]
            return [Realign(source, distance, settle=True), *fast]
        return fast

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
