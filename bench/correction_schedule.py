"""bench.correction_sim's schedule: who publishes and applies what, when, and how stale each
view says it is, on the virtual clock. A pure function of the speeds, H, the horizon, the lag
and the partition (:func:`schedule`), so every arm of a seed sees the same updates in the same
order. Moved out of bench/correction_sim.py unchanged (session 24), which re-exports the names
its callers and tests import there.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Literal

from merge.lack import lacked_updates
from merge.weighting import rounds_stale

RECENT = 8
"""node.network_swarm.live_learners counts the authors of the last max(8, 2 x live) applied
updates as learners: an author alone counts the others for its first updates alone."""
BACKLOG = 1 << 40
"""Tie-break offset of a held-back arrival per author (schedule's ``rotate``)."""
View = Literal["signed", "late", "apply", "lack"]
VIEWS: tuple[View, ...] = ("signed", "late", "apply", "lack")


@dataclass(frozen=True)
class Publication:
    """A learner's update as its author signs it."""

    index: int
    author: int
    time: float
    base_applied: int
    """Updates the author's replica held when the round started."""
    published_applied: int
    """Updates the author's replica held when it published (its own not yet)."""
    late: int
    """Of the updates the author applied while the round ran, those whose own base count was
    more than M - 1 below this round's: a whole swarm round older than its base."""
    alone: bool = False
    """Published inside the partition: its author saw no live peer."""
    claim: int = 0
    """The learner count its author signs: every learner outside the partition; inside it,
    itself and the other authors among its replica's last 8 applied updates."""

    @property
    def staleness(self) -> int:
        return self.published_applied - self.base_applied


@dataclass(frozen=True)
class Apply:
    """One replica applying one publication."""

    replica: int
    publication: int
    time: float
    missing: int
    """Updates this replica held before it that the publication's base lacked."""
    lack: int = 0
    """Other authors' updates this replica held, published no later than the publication,
    beyond the count of them its author held when it published (merge.lack: what the signed
    counts and the replica's signed times give, with no oracle)."""
    held_back: bool = False
    """The partition held it back (it arrives at the partition's end): an oracle's mark."""


@dataclass
class _Replica:
    applied: list[int] = field(default_factory=list)
    base: frozenset[int] = frozenset()
    round_start_count: int = 0


def schedule(
    speeds: list[float],
    steps: int,
    horizon: float,
    lag: float,
    partition: tuple[float, float] | None = None,
    rotate: bool = False,
) -> list[Publication | Apply]:
    """Every publication and apply of a replay, in processing order; pure.

    A publication is followed at once by its author's apply (the author's next round starts
    from that replica); the other replicas apply it ``lag`` later. At equal times arrivals go
    before publications, so with lag 0 a learner ending a round at the same time as a peer
    starts from the peer's update too. Arrivals after the horizon are still applied: every
    replica ends with every publication. With a ``partition`` (start, end), an arrival due
    inside it comes at its end instead, in publication order, or with ``rotate`` author by
    author, replica j taking author j + 1's whole backlog first, then j + 2's (replicas take
    one backlog in different orders, as nodes fetching from different peers first do).
    """
    if lag < 0 or steps < 1 or not speeds:
        raise ValueError("lag must be >= 0, steps >= 1 and there must be a learner.")
    num = len(speeds)
    replicas = [_Replica() for _ in speeds]
    pubs: list[Publication] = []
    bases: list[frozenset[int]] = []
    events: list[Publication | Apply] = []
    heap: list[tuple[float, int, int, int, int]] = []  # time, rank, order, learner/replica, pub
    for i, factor in enumerate(speeds):
        heap.append((steps * factor, 1, i, i, -1))
    heapq.heapify(heap)
    order = len(speeds)

    def apply(who: int, index: int, time: float) -> Apply:
        held = replicas[who].applied
        missing = sum(1 for k in held if k not in bases[index])
        pub = pubs[index]
        # Of the other authors' (merge.lack): the author holds all its own earlier ones.
        before = sum(1 for k in held if pubs[k].time <= pub.time and pubs[k].author != pub.author)
        own = sum(1 for k in range(index) if pubs[k].author == pub.author)
        held.append(index)
        lack = max(0, before - (pub.published_applied - own))
        return Apply(who, index, time, missing, lack, time > pub.time + lag)

    def inside(time: float) -> bool:
        return partition is not None and partition[0] <= time < partition[1]

    def arrival(time: float) -> float:
        return partition[1] if partition is not None and inside(time) else time

    while heap:
        time, rank, _, who, index = heapq.heappop(heap)
        if rank == 0:  # an arrival
            events.append(apply(who, index, time))
            continue
        if time > horizon:
            continue
        replica = replicas[who]
        during = [pubs[k] for k in replica.applied if k not in replica.base]
        bound = replica.round_start_count - (num - 1)
        late = sum(1 for v in during if v.base_applied < bound)
        recent = {pubs[k].author for k in replica.applied[-RECENT:]} - {who}
        pub = Publication(
            len(pubs), who, time, replica.round_start_count, len(replica.applied), late,
            inside(time), 1 + len(recent) if inside(time) else num,
        )  # fmt: skip
        pubs.append(pub)
        bases.append(replica.base)
        events += [pub, apply(who, pub.index, time)]
        replica.base, replica.round_start_count = frozenset(replica.applied), len(replica.applied)
        for j in range(num):
            if j != who:
                due = arrival(time + lag)
                key = (
                    order + (1 + (who - j) % num) * BACKLOG
                    if rotate and due > time + lag
                    else order
                )
                heapq.heappush(heap, (due, 0, key, j, pub.index))
                order += 1
        heapq.heappush(heap, (time + steps * speeds[who], 1, order, who, -1))
        order += 1
    return events


def view_rounds(view: View, pub: Publication, applied: Apply, learners: int) -> float:
    """The rounds stale an arm's view gives one apply (merge.weighting's units)."""
    if view == "apply":
        return rounds_stale(applied.missing, learners)
    if view == "lack":
        missed = lacked_updates(applied.lack, learners)
        return rounds_stale(pub.staleness + missed, learners, late=missed)
    return rounds_stale(pub.staleness, learners, late=pub.late if view == "late" else 0)


def view_staleness(view: View, pub: Publication, applied: Apply) -> int:
    """The staleness count the correction is gated on (> 0: judged against the momentum)."""
    return applied.missing if view == "apply" else pub.staleness
