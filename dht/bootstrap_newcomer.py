"""A newcomer whose bootstrap's DHT did not answer its first ping dials it again, for a bound.

A node that has no checkpoint yet (a newcomer, or a node killed before its first save: it
kept no known peers either) used to start its DHT member with hivemind's
`ensure_bootstrap_success`: when no bootstrap peer answered the DHT's first ping in time, it
exited with "DHTNode bootstrap failed: none of the initial_peers responded to a ping". p2pd
had connected to that peer a moment before (p2pd refuses to start when none answers), so the
peer was there, only slow: its DHT's process busy on a loaded machine, or its node stalled
(tests/swarm/test_restart_lost.py stops its peers' learners with SIGSTOP while the node
restarts; with `--max-rounds 14` one run's restart exited so). Issue 22 (must-have 7): a
node retries a slow or briefly absent bootstrap with bounded backoff, saying so in one line.

So every node's DHT member starts without that check (dht.network), and a newcomer whose
routing table is empty after it dials its bootstrap peers with the rejoiner's backoff
(dht.bootstrap_rejoin: 1 s doubling to 3 s, p2pd's connect and a DHT ping) until one answers,
for at most NEWCOMER_DHT_WAIT_S; then it exits as before, with what it tried. A known member
(it has a checkpoint) trains alone instead and never gives up (`alone`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from dht.swarm_config import SwarmError

logger = logging.getLogger(__name__)

NEWCOMER_DHT_WAIT_S = 45.0
"""How long a newcomer dials its bootstrap peers again while its DHT member knows no peer."""
TICK_S = 1.0


class Dialler(Protocol):
    """What the wait needs of dht.bootstrap_rejoin.Rejoiner."""

    peers: list[str]

    async def tick(self) -> None: ...


class DhtBootstrapError(SwarmError):
    """No bootstrap peer's DHT answered a newcomer within the bound."""


async def await_first_peer(
    rejoiner: Dialler,
    table_size: Callable[[], Awaitable[int]],
    *,
    wait_s: float = NEWCOMER_DHT_WAIT_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> float:
    """Seconds until this newcomer's DHT member knew a peer (0.0: at once), dialling the
    bootstrap peers through `rejoiner` meanwhile; DhtBootstrapError after `wait_s`."""
    started = clock()
    if await table_size() > 0:
        return 0.0
    logger.warning(
        "no bootstrap peer's DHT answered a ping (%d given); dialling them again for up to %.0f s",
        len(rejoiner.peers),
        wait_s,
    )
    while clock() - started < wait_s:
        await rejoiner.tick()
        if await table_size() > 0:
            waited = clock() - started
            logger.info("reached the swarm's DHT %.0f s after the first ping failed", waited)
            return waited
        await sleep(TICK_S)
    raise DhtBootstrapError(
        f"DHTNode bootstrap failed: none of the bootstrap peers' DHT ({', '.join(rejoiner.peers)}) "
        f"answered a ping within {wait_s:.0f} s; check --peers and that they are running"
    )
