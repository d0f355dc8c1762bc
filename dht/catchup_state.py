"""Wanted updates that a state will bring: no live peer serves them, but a live peer that serves
its state reports them applied (dht.catchup). Pure: no network, no clock.

Peers retain each author's last few updates (dht.retention); what they applied before that
lives only in their replicas. A node that missed those updates (restarted from an old
checkpoint, with no donor alive when it joined) wants them, no fetch can bring them, and
catch-up used to count them lost after the gap wait, although the gap's state download
(dht.realign_settle) then brought every one: session 21's 16-node run counted 103 such
`update_lost` events of one restarted node that ended at the swarm's applied set.

So an update no live peer offers for the gap wait is "needs state", not lost, while a live peer
that serves state named it applied within the gap wait (its summary): the gap then takes that
peer's state. It becomes lost when no such peer has named it for the gap wait (they left, or
took a state without it: a real loss is still declared), and is dropped, counted as brought by
a state, once the replica holds it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from dht.ranges import UpdateId


class AppliedSet(Protocol):
    def has_applied(self, author: str, seq: int) -> bool: ...


class StateWants:
    """Update ids waiting for a state, each with when a live peer last named it applied; at most
    `max_ids` (the least recently named forgotten first); not thread-safe."""

    def __init__(self, max_ids: int) -> None:
        if max_ids < 1:
            raise ValueError(f"max_ids must be >= 1, got {max_ids!r}.")
        self.max_ids = max_ids
        self._named_at: dict[UpdateId, float] = {}
        """Least recently named first."""
        self.num_brought = 0
        """Ids dropped because the replica came to hold them (a state brought them)."""

    def __contains__(self, uid: object) -> bool:
        return uid in self._named_at

    def __len__(self) -> int:
        return len(self._named_at)

    def __iter__(self) -> Iterator[UpdateId]:
        return iter(self._named_at)

    def note(self, uid: UpdateId, named_at: float) -> None:
        """A live peer that serves state named `uid` applied (and not held) at `named_at`."""
        last = max(named_at, self._named_at.pop(uid, named_at))
        self._named_at[uid] = last
        if len(self._named_at) > self.max_ids:
            del self._named_at[next(iter(self._named_at))]

    def named(self, uid: UpdateId, now: float) -> bool:
        """Refreshes `uid` when it waits here: True then."""
        if uid not in self._named_at:
            return False
        self.note(uid, now)
        return True

    def shift(self, by_s: float) -> None:
        """Every id named `by_s` later: this node did not run for that long (a stall)."""
        for uid in self._named_at:
            self._named_at[uid] += by_s

    def discard(self, uid: UpdateId) -> None:
        """Wanted again (a live peer holds it now)."""
        self._named_at.pop(uid, None)

    def sweep(self, now: float, applied: AppliedSet, stale_after_s: float) -> list[UpdateId]:
        """Drops the ids the replica holds now (counted in num_brought) and returns, dropped too,
        those no live peer named applied for `stale_after_s`: no state will bring them."""
        stale: list[UpdateId] = []
        for uid, named_at in list(self._named_at.items()):
            if applied.has_applied(*uid):
                del self._named_at[uid]
                self.num_brought += 1
            elif now - named_at >= stale_after_s:
                del self._named_at[uid]
                stale.append(uid)
        return stale
