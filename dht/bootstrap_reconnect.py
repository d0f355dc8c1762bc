"""When a running node dials its bootstrap peers again, and when it asks one for a relay slot
itself: the decisions of dht.bootstrap_rejoin's Rejoiner, pure (the clock and what p2pd and
the DHT said are passed in).

A node finds the swarm through its bootstrap peers once, at start; nothing in hivemind dials
them again. When the only public node of a small swarm is killed and restarts on the same
address, the nodes behind NAT never reconnect to it: hivemind's DHT dropped it from their
routing tables, and go-libp2p's autorelay does not reserve a slot again with a relay it
reserved with in the last hour (its candidate backoff, set on every reservation attempt). They
trained alone (bench.chaos --topology nat: 0.80x the loopback goodput). So, every tick:

- a node whose DHT routing table is empty dials every peer it knows (its rejoin list);
- a node connected to none of its bootstrap peers dials those (a restarted public node is
  found again, and learns this node into its own routing table);
- both with capped backoff (RejoinBackoff: 1, 2, 4, 8, 15, 15 ... s) while nobody answers;
- a node behind NAT that holds no relay slot reserves one itself with a connected bootstrap
  peer, again whenever that peer reconnects (a relay forgets a slot when its connection
  closes) and every RESERVATION_REFRESH_S (a relay keeps one for an hour). Behind NAT: it held
  an autorelay slot once, or NAT_GRACE_S after start it has neither a slot nor a public address
  (a home restarted while the relay was down: autorelay tried it then, and waits an hour).
"""

from __future__ import annotations

from collections.abc import Iterable, Set
from dataclasses import dataclass

from multiaddr import Multiaddr
from multiaddr.exceptions import Error as MultiaddrError

from dht.addresses import peer_id_of
from dht.bootstrap_retry import RejoinBackoff, RejoinBounds

RESERVATION_REFRESH_S = 600.0
"""A slot this node reserved itself is renewed this often (go-libp2p relays keep one 1 h)."""
NAT_GRACE_S = 30.0
"""Autorelay reserves a slot about 15 s after start when it can; a node with no public address
and no slot this long after start reserves one itself."""
RESERVATION_RETRY_S = 5.0
"""After a refused or failed reservation, the same relay is asked again no sooner than this."""


@dataclass(frozen=True)
class ReconnectPlan:
    """What to do now: the addresses to dial, and the relay (peer id) to reserve a slot with."""

    dial: tuple[str, ...] = ()
    reserve_with: str | None = None


NOTHING = ReconnectPlan()


class ReconnectPolicy:
    """Decides, from one look at this node's connections, whom to dial and where to reserve.

    `bootstraps` and `known` are full addresses (ending in /p2p/ID); `wants_relay`: this node
    asks for relay slots (--auto-relay without --announce)."""

    def __init__(
        self,
        bootstraps: Iterable[str],
        known: Iterable[str],
        *,
        wants_relay: bool,
        now: float,
        bounds: RejoinBounds | None = None,
    ) -> None:
        self.bootstraps = _with_peer_ids(bootstraps)
        self.known = _with_peer_ids(known) or self.bootstraps
        self.wants_relay = wants_relay
        self.backoff = RejoinBackoff(bounds or RejoinBounds(), now)
        self.started_at = now
        self.behind_nat = False
        """This node held an autorelay slot, or had no public address NAT_GRACE_S after start."""
        self.reserved: dict[str, float] = {}
        """Relay peer id -> when this node reserved a slot with it itself (while connected)."""
        self._retry_at: dict[str, float] = {}

    @property
    def bootstrap_ids(self) -> list[str]:
        return list(dict.fromkeys(peer for _, peer in self.bootstraps))

    def plan(
        self,
        now: float,
        *,
        table_size: int,
        connected: Set[str],
        relays: Set[str],
        public_address: bool = False,
    ) -> ReconnectPlan:
        """`table_size`: peers in the DHT routing table; `connected`: peer ids p2pd holds a
        connection to; `relays`: relays in this node's own addresses (autorelay's slots);
        `public_address`: p2pd lists a public address of this node's own."""
        # a relay forgets a slot when the connection it was reserved on closes
        self.reserved = {r: t for r, t in self.reserved.items() if r in connected}
        ids = self.bootstrap_ids
        if table_size == 0:
            candidates = self.known
        elif ids and not any(peer in connected for peer in ids):
            candidates = self.bootstraps
        else:
            candidates = []
            self.backoff.connected(now)
        dial = tuple(m for m, _ in candidates) if candidates and self.backoff.alone(now) else ()
        relay = self._relay_to_ask(now, connected, relays, public_address)
        return ReconnectPlan(dial=dial, reserve_with=relay)

    def _relay_to_ask(
        self, now: float, connected: Set[str], relays: Set[str], public_address: bool
    ) -> str | None:
        if not self.wants_relay:
            return None
        if relays:  # autorelay holds a slot: the node is behind NAT, and reachable
            self.behind_nat = True
            return None
        if not public_address and now - self.started_at >= NAT_GRACE_S:
            self.behind_nat = True
        if not self.behind_nat:  # public, or AutoNAT has not said yet: autorelay decides
            return None
        if any(now - at < RESERVATION_REFRESH_S for at in self.reserved.values()):
            return None
        live = [p for p in self.bootstrap_ids if p in connected]
        due = [p for p in live if now >= self._retry_at.get(p, now)]
        return due[0] if due else None

    def dialled(self, now: float, *, reached: bool) -> float:
        """A dial at `now` of the planned addresses ended; seconds until the next may be due."""
        if reached:  # the next tick sees the connection; if it closed again, wait a little
            return self.backoff.reached(now)
        return self.backoff.failed(now)

    def reservation(self, relay: str, now: float, *, ok: bool) -> None:
        """A reservation asked of `relay` at `now` ended (ok: the relay granted a slot)."""
        if ok:
            self.reserved[relay] = now
            self._retry_at.pop(relay, None)
        else:
            self._retry_at[relay] = now + RESERVATION_RETRY_S


def _with_peer_ids(maddrs: Iterable[str]) -> list[tuple[str, str]]:
    """(address, peer id) of each distinct address that names its peer (others left out)."""
    found = []
    for maddr in dict.fromkeys(maddrs):
        try:
            found.append((maddr, peer_id_of(Multiaddr(maddr))))
        except (ValueError, MultiaddrError):
            continue
    return found
