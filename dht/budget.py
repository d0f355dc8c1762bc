"""Per-peer budgets: a flood slows the flooder, not the node.

A token bucket per peer, in bounded memory: each peer may send `burst` messages at once and
`rate_per_s` on average; beyond that its messages are dropped (and counted by the caller).
Buckets of peers that fall silent are the first evicted when the table is full.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class _Bucket:
    tokens: float
    updated_at: float


class PeerBudget:
    """Token buckets keyed by peer id; `allow` is O(1) and never grows past `max_peers`."""

    def __init__(self, *, rate_per_s: float, burst: float, max_peers: int = 4096) -> None:
        if rate_per_s <= 0 or burst < 1 or max_peers < 1:
            raise ValueError("a budget needs rate_per_s > 0, burst >= 1 and max_peers >= 1.")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._max_peers = max_peers
        self._buckets: OrderedDict[str, _Bucket] = OrderedDict()

    def allow(self, peer_id: str, now: float) -> bool:
        """Spends one token of `peer_id`'s budget; False when it has none left."""
        return self.take(peer_id, 1, now) == 1

    def take(self, peer_id: str, cost: int, now: float) -> int:
        """Spends up to `cost` whole tokens of `peer_id`'s budget: the number granted (work
        such as update ids to look for; what is not granted is not done)."""
        bucket = self._buckets.pop(peer_id, None) or _Bucket(self.burst, now)
        elapsed = max(0.0, now - bucket.updated_at)
        bucket.tokens = min(self.burst, bucket.tokens + elapsed * self.rate_per_s)
        bucket.updated_at = now
        granted = max(0, min(cost, int(bucket.tokens)))
        bucket.tokens -= granted
        self._buckets[peer_id] = bucket  # most recently active last
        while len(self._buckets) > self._max_peers:
            self._buckets.popitem(last=False)
        return granted

    def forget(self, peer_id: str) -> None:
        self._buckets.pop(peer_id, None)

    def __len__(self) -> int:
        return len(self._buckets)


@dataclass(frozen=True, kw_only=True)
class StreamLimits:
    """What one peer may ask of a stream handler."""

    rate_per_s: float
    """Streams a peer may open per second on average."""
    burst: float
    """Streams a peer may open at once after a quiet spell."""
    max_in_flight: int = 4
    """Streams of one peer served at the same time; more are refused."""
    deadline_s: float = 30.0
    """A stream still running after this long is cut (and counted against the peer)."""

    def __post_init__(self) -> None:
        if not (self.rate_per_s > 0 and self.burst >= 1 and self.max_in_flight >= 1):
            raise ValueError("stream limits need rate_per_s > 0, burst >= 1, max_in_flight >= 1.")
        if not self.deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {self.deadline_s!r}.")


class StreamGuard:
    """Decides whether a peer's new stream is served: its rate budget, then its streams in
    flight. Memory stays bounded: buckets are evicted LRU, in-flight counts drop to nothing."""

    def __init__(self, limits: StreamLimits, *, max_peers: int = 4096) -> None:
        self.limits = limits
        self._budget = PeerBudget(
            rate_per_s=limits.rate_per_s, burst=limits.burst, max_peers=max_peers
        )
        self._in_flight: dict[str, int] = {}

    def admit(self, peer_id: str, now: float) -> str | None:
        """None when the stream is served (then `release` it when it ends); else the reason
        it is refused: "busy" (too many of its streams running) or "rate" (budget spent)."""
        if self._in_flight.get(peer_id, 0) >= self.limits.max_in_flight:
            return "busy"
        if not self._budget.allow(peer_id, now):
            return "rate"
        self._in_flight[peer_id] = self._in_flight.get(peer_id, 0) + 1
        return None

    def release(self, peer_id: str) -> None:
        left = self._in_flight.get(peer_id, 0) - 1
        if left > 0:
            self._in_flight[peer_id] = left
        else:
            self._in_flight.pop(peer_id, None)

    def in_flight(self, peer_id: str) -> int:
        return self._in_flight.get(peer_id, 0)

    @property
    def num_tracked(self) -> int:
        """Peers with a bucket or a stream in flight (bounded by max_peers + streams running)."""
        return len(self._budget) + len(self._in_flight)
