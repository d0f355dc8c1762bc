"""When to re-dial a peer this node reaches only through a relay, so that one of the two can
punch a hole (DCUtR) to it: a pure policy, the clock passed in.

go-libp2p 0.32 (hivemind 1.1.12's p2pd) starts a hole punch once, on the side that receives an
inbound relayed connection, when that connection opens, and only if the other side already
serves DCUtR, which it does once identify has confirmed a public observed address of it (4
observers of distinct IPs). Two homes that joined together first meet through the relay while
those addresses are not yet confirmed: that punch fails ("protocols not supported") and the
relayed connection, kept open, never brings another (docs/nat.md). A fresh relayed connection,
dialled once both sides had time, lets the other side start a punch that works (9.5 ms between
two cone NATs in bench.punch_probe).

So: a peer seen only through a relay for `relayed_s`, once this node has run `settle_s`, is
disconnected and dialled again through its relay, `max_per_peer` times at most while it stays
connected. Of two such peers the one whose id sorts first re-dials first, the other
`stagger_s` later if the pair is still relayed, so that their two re-dials do not cut each
other's fresh connection. A peer gone for `forget_s` is forgotten (a restarted peer gets a new
chance); at most `max_per_round` re-dials are asked per call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dht.reachability import PathKind


@dataclass(frozen=True, kw_only=True)
class RedialSettings:
    """How soon, how often and how many relayed peers a node re-dials to let DCUtR punch."""

    settle_s: float = 25.0
    """Seconds after this node started before any re-dial (identify confirms its observed
    address, the relay reserves its slot, ~15 s)."""
    relayed_s: float = 10.0
    """Seconds a peer must have been seen only relayed (the other side's handler is up)."""
    stagger_s: float = 15.0
    """Extra wait of the side whose peer id sorts last: the pair's re-dials do not collide."""
    forget_s: float = 60.0
    """A peer not connected for this long is forgotten; when it comes back it may be re-dialled
    again (a restarted peer)."""
    max_per_peer: int = 3
    """Re-dials of one peer while it stays known. One was not enough: in session 15's fresh-clone
    CI both homes re-dialled once and DCUtR punched nothing, where the same test alone punched
    after one (the simultaneous open through two NATs is timed over the relay's round trip and
    misses under load); each re-dial is a fresh attempt, `relayed_s` after the last."""
    max_per_round: int = 4
    """Re-dials asked per call: a node relayed to many peers does not drop all at once."""

    def __post_init__(self) -> None:
        for name in ("settle_s", "relayed_s", "stagger_s"):
            if not 0.0 <= getattr(self, name) <= 3600.0:
                raise ValueError(f"{name} must be 0 to 3600 seconds, got {getattr(self, name)}")
        if not self.forget_s > 0:
            raise ValueError(f"forget_s must be positive, got {self.forget_s}")
        if self.max_per_peer < 0 or self.max_per_round < 1:
            raise ValueError("max_per_peer must be >= 0 and max_per_round >= 1")


class RedialPolicy:
    """Which relayed peers to re-dial now, from each observation of the paths (dht.reachability:
    PathBook) and the time; it remembers what it asked, so the caller only re-dials."""

    def __init__(self, own_id: str, started_at: float, settings: RedialSettings) -> None:
        self.own_id = own_id
        self.started_at = started_at
        self.settings = settings
        self._relayed_since: dict[str, float] = {}
        self._last_seen: dict[str, float] = {}
        self._redials: dict[str, int] = {}
        self._could_punch = False

    def due(
        self, now: float, paths: Mapping[str, PathKind], *, can_punch: bool = True
    ) -> list[str]:
        """The peers to re-dial through their relay now (each counted as re-dialled), given
        every connected peer's path now. ``can_punch``: p2pd lists a public observed address
        of this node now (a cone NAT seen by 4 observers, or a public host). A node that never
        could (a symmetric NAT, too few observers) only watches, since its re-dials would cut
        live relayed connections for a punch that cannot start (session 12's NAT chaos run: 12
        re-dials, no punch possible). Once it could, it can for good: go-libp2p serves DCUtR
        from the first public observed address on (holepunch/svc.go: watchForPublicAddr), but
        p2pd stops listing that address as soon as autorelay holds a slot (relay_finder.go:
        relayAddrs keeps private and relayed addresses only), ~15 s after the start and
        before `settle_s`: read as "now", no home ever re-dialled (tests/swarm/test_nat.py's
        punch test, docs/nat.md)."""
        self._observe(now, paths)
        self._could_punch = self._could_punch or can_punch
        if not self._could_punch:
            return []
        ready = [
            (since, peer)
            for peer, since in self._relayed_since.items()
            if paths.get(peer) == "relayed"
            and self._redials.get(peer, 0) < self.settings.max_per_peer
            and now >= self._due_at(peer, since)
        ]
        chosen = [peer for _, peer in sorted(ready)[: self.settings.max_per_round]]
        for peer in chosen:
            self._redials[peer] = self._redials.get(peer, 0) + 1
            self._relayed_since[peer] = now  # a later re-dial (max_per_peer > 1) waits again
        return chosen

    def redials(self, peer: str) -> int:
        """How many times `peer` was re-dialled since it was last forgotten."""
        return self._redials.get(peer, 0)

    def _due_at(self, peer: str, relayed_since: float) -> float:
        s = self.settings
        at = max(self.started_at + s.settle_s, relayed_since + s.relayed_s)
        return at if self.own_id < peer else at + s.stagger_s

    def _observe(self, now: float, paths: Mapping[str, PathKind]) -> None:
        for peer, kind in paths.items():
            self._last_seen[peer] = now
            if kind == "relayed":
                self._relayed_since.setdefault(peer, now)
            else:  # direct or punched: nothing to do
                self._relayed_since.pop(peer, None)
        for peer, seen in list(self._last_seen.items()):
            # a short gap keeps the peer's wait (a relay that cuts circuits every 128 KiB makes
            # relayed connections come and go); a long one forgets it
            if peer not in paths and now - seen >= self.settings.forget_s:
                del self._last_seen[peer]
                self._relayed_since.pop(peer, None)
                self._redials.pop(peer, None)
