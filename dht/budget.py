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
        bucket = self._buckets.pop(peer_id, None) or _Bucket(self.burst, now)
        elapsed = max(0.0, now - bucket.updated_at)
        bucket.tokens = min(self.burst, bucket.tokens + elapsed * self.rate_per_s)
        bucket.updated_at = now
        allowed = bucket.tokens >= 1
        if allowed:
            bucket.tokens -= 1
        self._buckets[peer_id] = bucket  # most recently active last
        while len(self._buckets) > self._max_peers:
            self._buckets.popitem(last=False)
        return allowed

    def forget(self, peer_id: str) -> None:
        self._buckets.pop(peer_id, None)

    def __len__(self) -> int:
        return len(self._buckets)
