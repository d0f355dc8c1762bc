"""A known member that finds no peer at start trains on its checkpoint and dials the peers it
knows in the background until one answers; it merges what it missed through gossip then.

A node with a checkpoint whose bootstrap and known peers are all down (a small swarm where
every other node restarts at once, or a bootstrap gone for good) used to exit with "DHTNode
bootstrap failed". Its DHT member now starts alone (hivemind's ensure_bootstrap_success off);
`Rejoiner.tick`, every REJOIN_TICK_S on the swarm's loop, dials the known peers whenever this
node's DHT routing table is empty, with capped backoff (dht.bootstrap_retry.RejoinBackoff).
Dialling is p2pd's connect and a DHT ping: both ends add each other to their routing tables,
and the next heartbeat and poll find the swarm again. One console line says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from dht.bootstrap_retry import MAX_KNOWN_TRIED, RejoinBackoff, RejoinBounds

logger = logging.getLogger(__name__)

REJOIN_TICK_S = 1.0
"""How often the routing table is checked for being empty (a pipe round trip to the DHT)."""
DIAL_TIMEOUT_S = 5.0
"""The longest one dial (connect and ping) may take."""


class Rejoiner:
    """Dials `peers` (most recently seen first, at most MAX_KNOWN_TRIED) while this node's DHT
    member knows no peer."""

    def __init__(
        self,
        network: Any,  # dht.network.SwarmNetwork: dht_peer_count(), dial(maddr, timeout_s)
        peers: list[str],
        *,
        bounds: RejoinBounds | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.network = network
        self.peers = list(dict.fromkeys(peers))[:MAX_KNOWN_TRIED]
        self._clock = clock
        self.backoff = RejoinBackoff(bounds or RejoinBounds(), clock())
        self.alone_since: float | None = None
        self.num_rejoined = 0

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
        """Dial if this node knows no peer and a dial is due."""
        now = self._clock()
        if await self.network.dht_peer_count() > 0:
            if self.alone_since is not None:
                self.num_rejoined += 1
                logger.info("back in the swarm after %.0f s alone", now - self.alone_since)
                self.alone_since = None
            self.backoff.connected(now)
            return
        if self.alone_since is None:
            self.alone_since = now
        if not self.peers or not self.backoff.alone(now):
            return
        reached = await asyncio.gather(
            *(self.network.dial(m, DIAL_TIMEOUT_S) for m in self.peers), return_exceptions=True
        )
        if not any(r is True for r in reached):
            wait_s = self.backoff.failed(self._clock())
            logger.debug("no known peer answered; next dial in %.0f s", wait_s)
