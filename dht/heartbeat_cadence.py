"""When this node stores its heartbeat: on a fixed cadence, not a period after the last store.

A peer is alive in another node's view while a heartbeat newer than the last one it saw comes
within three periods (dht.membership). Stored as "wait a period, then store", the interval
between two heartbeats was a period plus the store's time, and a DHT store on a loaded machine
(16 nodes on 2 cores: 48 processes) took seconds: peers saw the node go silent and come back
seconds later (session 19's bench: ~200 single-peer flaps per run after the loop stalls were
fixed). Here the next store starts a period after the last one *started*; one still in flight
does not hold it back (at most `MAX_IN_FLIGHT` at once), so one slow store costs nothing and
only a store slower than two periods leaves a gap (`Cadence.done` names it).

Pure: the caller passes its monotonic clock (dht.swarm runs it on the network's loop).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_IN_FLIGHT = 2
"""Heartbeat stores at once: a second starts while a slow first is still in flight."""

LATE_PERIODS = 2.0
"""Periods between two stored heartbeats past which the gap is reported: three make this node
look silent to its peers."""


@dataclass
class Cadence:
    period_s: float
    next_at: float
    """When the next store is due (monotonic seconds)."""
    in_flight: int = 0
    last_stored: float | None = None
    """When the last store that succeeded returned."""

    def wait_s(self, now: float) -> float:
        """Seconds until the next store is due (0 when it is)."""
        return max(0.0, self.next_at - now)

    def start(self, now: float) -> bool:
        """Whether to start a store now (it is due and fewer than MAX_IN_FLIGHT run); the next
        one is due a period after this one, or a period from now after a stall."""
        if now < self.next_at:
            return False
        self.next_at += self.period_s
        if self.next_at <= now:  # a stall: the cadence starts again from now
            self.next_at = now + self.period_s
        if self.in_flight >= MAX_IN_FLIGHT:
            return False
        self.in_flight += 1
        return True

    def done(self, now: float, *, stored: bool) -> float | None:
        """A store returned; the gap since the last one stored when it exceeds LATE_PERIODS
        periods (else None)."""
        self.in_flight = max(0, self.in_flight - 1)
        if not stored:
            return None
        previous, self.last_stored = self.last_stored, now
        if previous is not None and now - previous > LATE_PERIODS * self.period_s:
            return now - previous
        return None
