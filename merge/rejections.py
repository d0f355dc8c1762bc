"""Rejections counted per peer and reason, in bounded memory.

Every input a node refuses (an update, a header, a heartbeat, a state) costs the sender a
counter increment here. The totals by reason are exact; the per-peer table keeps the
`max_peers` peers with the most rejections, so a flood of fresh identities cannot grow it.
"""

from __future__ import annotations

import threading
from collections import Counter

MAX_PEERS = 256
MAX_REASON_CHARS = 64


class RejectionLog:
    """Thread-safe: the merge thread, the network loop and the dashboard all use it."""

    def __init__(self, max_peers: int = MAX_PEERS) -> None:
        self._lock = threading.Lock()
        self._by_reason: Counter[str] = Counter()
        self._by_peer: dict[str, Counter[str]] = {}
        self._max_peers = max_peers

    def count(self, peer_id: str, reason: str, n: int = 1) -> None:
        reason = reason[:MAX_REASON_CHARS]
        peer_id = str(peer_id)[:128]
        with self._lock:
            self._by_reason[reason] += n
            per_peer = self._by_peer.get(peer_id)
            if per_peer is None:
                self._make_room()
                per_peer = self._by_peer[peer_id] = Counter()
            per_peer[reason] += n

    def forget(self, peer_id: str) -> None:
        """Drops a peer's row (it left); the totals by reason keep its rejections."""
        with self._lock:
            self._by_peer.pop(peer_id, None)

    def by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._by_reason.items()))

    def by_peer(self, limit: int | None = None) -> dict[str, dict[str, int]]:
        """peer -> reason -> count, the peers with most rejections first."""
        with self._lock:
            rows = sorted(self._by_peer.items(), key=lambda kv: -sum(kv[1].values()))
            return {peer: dict(sorted(c.items())) for peer, c in rows[:limit]}

    def top(self, max_peers: int, max_reasons: int) -> dict[str, dict[str, int]]:
        """The `max_peers` most rejected peers, each with its `max_reasons` main reasons."""
        with self._lock:
            rows = sorted(self._by_peer.items(), key=lambda kv: -sum(kv[1].values()))
            return {peer: dict(c.most_common(max_reasons)) for peer, c in rows[:max_peers]}

    def _make_room(self) -> None:
        if len(self._by_peer) < self._max_peers:
            return
        smallest = min(self._by_peer, key=lambda peer: sum(self._by_peer[peer].values()))
        del self._by_peer[smallest]
