"""A node that loses the swarm finds it again: it dials its bootstrap and known peers in the
background, and asks a relay for a slot itself when p2pd's autorelay will not.

A known member (it has a checkpoint) whose bootstrap and known peers are all down at start
trains on its checkpoint (its DHT member starts alone: hivemind's ensure_bootstrap_success
off) instead of exiting with "DHTNode bootstrap failed". Any node whose DHT routing table
empties, or that is connected to none of its bootstrap peers (the swarm's only public node
was killed and restarted), dials them again; a node behind NAT that lost its relay slot
reserves one with a bootstrap peer it is connected to. `Rejoiner.tick`, every REJOIN_TICK_S on
the swarm's loop, looks and acts; dht.bootstrap_reconnect's ReconnectPolicy decides.
Dialling is p2pd's connect and a DHT ping: both ends add each other to their routing tables,
and the next heartbeat and poll find the swarm again. One console line says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from dht.bootstrap_reconnect import ReconnectPolicy
from dht.bootstrap_retry import MAX_KNOWN_TRIED, RejoinBackoff, RejoinBounds
from dht.doctor import is_public_maddr
from dht.reachability import relay_of

logger = logging.getLogger(__name__)

REJOIN_TICK_S = 1.0
"""How often the routing table and connections are looked at (a pipe round trip to the DHT,
one to p2pd)."""
QUIET_ALONE_S = 10.0
"""A routing table empty for less than this is refilled without a console line."""
DIAL_TIMEOUT_S = 5.0
"""The longest one dial (connect and ping) may take."""


class Rejoiner:
    """Dials `peers` (most recently seen first, at most MAX_KNOWN_TRIED) while this node's DHT
    member knows no peer, `bootstraps` while it is connected to none of them, and reserves
    relay slots (`wants_relay`) when it is behind NAT and holds none."""

    def __init__(
        self,
        network: Any,  # dht.network.SwarmNetwork: dht_peer_count, connected_peers, dial, ...
        peers: list[str],
        *,
        bootstraps: list[str] | None = None,
        wants_relay: bool = False,
        bounds: RejoinBounds | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.network = network
        self.peers = list(dict.fromkeys(peers))[:MAX_KNOWN_TRIED]
        self._clock = clock
        self.policy = ReconnectPolicy(
            self.peers if bootstraps is None else bootstraps,
            self.peers,
            wants_relay=wants_relay,
            now=clock(),
            bounds=bounds,
        )
        self.alone_since: float | None = None
        self.num_rejoined = 0
        self.num_redialled = 0
        """Dials that reached a peer after this node had lost its bootstrap peers."""
        self.num_reserved = 0
        """Relay slots this node reserved itself."""

    @property
    def backoff(self) -> RejoinBackoff:
        return self.policy.backoff

    async def check_start(self) -> bool:
        """Right after the DHT started: whether it found nobody (then one line says that the
        node trains on its checkpoint and keeps dialling)."""
        if await self.network.dht_peer_count() > 0:
            return False
        self.alone_since = self._clock()
        logger.warning(
            "no peer of the swarm answers (%d known); training on the checkpoint and dialling "
            "them in the background every %.0f-%.0f s",
            len(self.peers),
            self.backoff.bounds.first_delay_s,
            self.backoff.bounds.max_delay_s,
        )
        return True

    async def tick(self) -> None:
        """Look at the routing table and the connections; dial or reserve if due."""
        now = self._clock()
        table_size = await self.network.dht_peer_count()
        if table_size > 0 and self.alone_since is not None:
            self.num_rejoined += 1
            alone_s = now - self.alone_since  # hivemind empties a table for a moment at times
            level = logging.INFO if alone_s >= QUIET_ALONE_S else logging.DEBUG
            logger.log(level, "back in the swarm after %.0f s alone", alone_s)
            self.alone_since = None
        elif table_size == 0 and self.alone_since is None:
            self.alone_since = now
        connected = await self.network.connected_peers()
        own = self.network.p2pd_maddrs
        plan = self.policy.plan(
            now,
            table_size=table_size,
            connected=connected,
            relays={r for r in map(relay_of, own) if r},
            public_address=any(map(is_public_maddr, own)),
        )
        if plan.dial:
            await self._dial(plan.dial, alone=table_size == 0)
        if plan.reserve_with is not None:
            await self._reserve(plan.reserve_with)
        self.network.set_relayed(
            [f"{m}/p2p-circuit/p2p/{self.network.peer_id}" for m in self._reserved_maddrs()]
        )

    async def _dial(self, maddrs: tuple[str, ...], *, alone: bool) -> None:
        reached = await asyncio.gather(
            *(self.network.dial(m, DIAL_TIMEOUT_S) for m in maddrs), return_exceptions=True
        )
        answered = [m for m, r in zip(maddrs, reached, strict=True) if r is True]
        wait_s = self.policy.dialled(self._clock(), reached=bool(answered))
        if answered and not alone:
            self.num_redialled += 1
            logger.info("reconnected to bootstrap peer %s", answered[0])
        elif not answered:
            logger.debug("no peer answered of %d dialled; next dial in %.0f s", len(maddrs), wait_s)

    async def _reserve(self, relay: str) -> None:
        ok = await self.network.reserve_relay_slot(relay, DIAL_TIMEOUT_S)
        self.policy.reservation(relay, self._clock(), ok=ok)
        if ok:
            self.num_reserved += 1
            logger.info("reserved a relay slot with %s (p2pd's autorelay holds none)", relay)

    def _reserved_maddrs(self) -> list[str]:
        return [m for m, peer in self.policy.bootstraps if peer in self.policy.reserved]
