"""Which path each connection took and how the world reaches this node (`SwarmNetwork`'s
part): the path book read from p2pd's connections, the re-dials that let DCUtR punch a hole
(dht.network_punch), relay slots and this node's visible addresses."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Coroutine
from typing import Any

from hivemind import DHT
from hivemind.p2p import P2P, P2PDaemonError
from hivemind.p2p.p2p_daemon_bindings.control import DaemonConnector
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from multiaddr import Multiaddr

from dht.doctor import is_public_maddr
from dht.network_punch import RedialPolicy
from dht.p2pd import HOP_STATUS_OK, connect, disconnect, reserve_slot
from dht.reachability import PathBook, connections_by_peer, is_relayed, relay_of
from dht.swarm_config import REQUEST_READ_TIMEOUT_S, SwarmConfig
from dht.transport import TransportError

logger = logging.getLogger(__name__)
REDIAL_TIMEOUT_S = 15.0
"""Bound on one re-dial of a relayed peer through its relay (dht.network_punch)."""


class NetworkPaths:
    """Paths and addresses; mixed into dht.network.SwarmNetwork, which starts p2pd and the
    DHT and sets the attributes below."""

    config: SwarmConfig
    _p2p: P2P | None
    _control: DaemonConnector | None
    _dht: DHT | None
    paths: PathBook
    _redial: RedialPolicy
    nat_peers: Callable[[], Collection[str]]
    _behind_nat: bool
    on_addresses: Callable[[list[str]], None] | None
    visible_maddrs: list[str]
    p2pd_maddrs: list[str]
    _relayed: list[str]

    every: Callable[[float, Callable[[], Coroutine[Any, Any, None]]], None]
    spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]

    async def _watch_paths(self) -> None:
        self.every(self.config.heartbeat_period_s, self.refresh_paths)

    async def refresh_paths(self) -> None:
        """Re-read which path each connection took, and this node's addresses (a relayed one
        appears once a relay has reserved this node a slot)."""
        assert self._p2p is not None
        peers = await asyncio.wait_for(self._p2p.list_peers(), REQUEST_READ_TIMEOUT_S)
        before = self.paths.counts()
        connections = connections_by_peer((str(p.peer_id), map(str, p.addrs)) for p in peers)
        self.paths.observe(connections, self._punchable_peers())
        now = self.paths.counts()
        if now != before:
            logger.info("connections: %s", ", ".join(f"{n} {kind}" for kind, n in now.items()))
        can_punch = any(map(is_public_maddr, self.p2pd_maddrs))
        for peer in self._redial.due(time.monotonic(), self.paths.current(), can_punch=can_punch):
            self.spawn(self._redial_through_relay(peer, connections.get(peer, [])))
        # latest: ask p2pd again; its first answer, cached by hivemind, predates any relay slot
        own = await asyncio.wait_for(
            self._p2p.get_visible_maddrs(latest=True), REQUEST_READ_TIMEOUT_S
        )
        self.p2pd_maddrs = [str(m) for m in own]
        self._update_visible()

    async def _redial_through_relay(self, peer_id: str, addrs: list[str]) -> None:
        """Close this node's relayed connection to `peer_id` and dial it again through the same
        relay: the fresh inbound relayed connection makes the peer start a hole punch, which
        its first one may have tried before this node served DCUtR (dht.network_punch)."""
        assert self._control is not None
        relayed = [Multiaddr(a) for a in addrs if is_relayed(a) and relay_of(a)]
        try:
            await asyncio.wait_for(disconnect(self._control, peer_id), REQUEST_READ_TIMEOUT_S)
            await asyncio.wait_for(connect(self._control, peer_id, relayed), REDIAL_TIMEOUT_S)
        except (TimeoutError, OSError, ValueError, ControlFailure) as exc:
            logger.info("re-dialling %s through its relay failed: %s", peer_id, exc)
            return
        logger.info("re-dialled %s through its relay, so that a hole punch can start", peer_id)

    def set_relayed(self, maddrs: list[str]) -> None:
        """This node's relayed addresses through the slots it reserved itself (Rejoiner)."""
        self._relayed = maddrs
        self._update_visible()

    def _update_visible(self) -> None:
        seen = self.p2pd_maddrs + [m for m in self._relayed if m not in self.p2pd_maddrs]
        changed, self.visible_maddrs = seen != self.visible_maddrs, seen
        self._behind_nat = self._behind_nat or any(map(is_relayed, seen))
        if changed and self.on_addresses is not None:
            self.on_addresses(seen)

    async def connected_peers(self) -> set[str]:
        """Peer ids p2pd holds a connection to now."""
        assert self._p2p is not None
        peers = await asyncio.wait_for(self._p2p.list_peers(), REQUEST_READ_TIMEOUT_S)
        return {str(p.peer_id) for p in peers}

    async def reserve_relay_slot(self, relay: str, timeout_s: float) -> bool:
        """Ask connected peer `relay` for a relay slot (dht.p2pd.reserve_slot); granted?"""
        assert self._control is not None
        try:
            status = await asyncio.wait_for(reserve_slot(self._control, relay), timeout_s)
        except (TimeoutError, OSError, TransportError) as exc:
            logger.debug("reserving a relay slot with %s failed: %s", relay, exc)
            return False
        if status != HOP_STATUS_OK:
            logger.debug("relay %s refused a slot: status %d", relay, status)
        return status == HOP_STATUS_OK

    async def path_to(self, peer_id: str) -> str | None:
        """The path (direct, holepunched, relayed) of this node's connection to `peer_id` now,
        read from p2pd (None: not connected, or p2pd did not answer); the path book learns it
        too."""
        return self.paths.path(peer_id) if await self.read_paths() else None

    async def read_paths(self) -> bool:
        """Read the path of every connection from p2pd into `paths` now; False (the book left
        as it was) when p2pd did not answer."""
        assert self._p2p is not None
        try:
            peers = await asyncio.wait_for(self._p2p.list_peers(), REQUEST_READ_TIMEOUT_S)
        except (TimeoutError, OSError, P2PDaemonError, ControlFailure) as exc:
            logger.debug("listing connections failed: %s", exc)
            return False
        connections = connections_by_peer((str(p.peer_id), map(str, p.addrs)) for p in peers)
        self.paths.observe(connections, self._punchable_peers())
        return True

    def _punchable_peers(self) -> Collection[str]:
        """Peers a direct connection to can only have come from a hole punch: NAT'd ones,
        while this node is NAT'd too."""
        return self.nat_peers() if self._behind_nat else ()

    def read_visible_maddrs(self) -> list[str]:
        assert self._dht is not None
        self.p2pd_maddrs = [str(m) for m in self._dht.get_visible_maddrs(latest=True)]
        self.visible_maddrs = list(self.p2pd_maddrs)
        return self.visible_maddrs
