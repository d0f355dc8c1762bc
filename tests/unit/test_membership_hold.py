"""A membership read that misses this node's own heartbeat proves no peer absent.

~1,000 Sybil heartbeats make the peers record too large to read whole within the poll's
bound (bench.attack sybil): before, each honest node then dropped the other and sized its
updates as a lone learner. The DHT is replaced by the records a read returned, which is the
input this rule decides on; tests/swarm prove the wiring on real hivemind DHTs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dht.heartbeat import Heartbeat
from dht.membership import Membership
from dht.network import Rejections, SwarmConfig
from dht.records import owner_subkey
from merge.identity import Identity

PERIOD = 0.05


class Reads:
    """What each dht_get returns, in turn (the last one repeats)."""

    def __init__(self, config: SwarmConfig, reads: list[dict[Any, Any]]) -> None:
        self.config, self.reads = config, reads

    async def dht_get(self, key: str) -> dict[Any, Any]:
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]

    async def dht_store(self, *args: Any) -> None:
        return None


def membership(me: Identity, reads: list[dict[Any, Any]]) -> Membership:
    config = SwarmConfig(
        run_id="r",
        fingerprint="f" * 64,
        run_summary={},
        identity_path="",
        heartbeat_period_s=PERIOD,
    )
    return Membership(
        Reads(config, reads),  # type: ignore[arg-type]
        me,
        heartbeat_fn=lambda: Heartbeat(peer_id=me.peer_id),
        reject=Rejections(lambda result: None),
        on_event=lambda *a, **k: None,
    )


def record(identity: Identity) -> dict[str, bytes]:
    return {owner_subkey(identity.peer_id): Heartbeat(peer_id=identity.peer_id).sign(identity)}


def poll_for(m: Membership, seconds: float) -> None:
    end = time.time() + seconds
    while time.time() < end:
        asyncio.run(m.poll())
        time.sleep(PERIOD / 2)


def test_a_peer_stays_alive_while_reads_miss_our_own_heartbeat() -> None:
    me, peer = Identity.generate(), Identity.generate()
    m = membership(me, [record(me) | record(peer), {}])
    asyncio.run(m.send_heartbeat())
    asyncio.run(m.poll())
    assert m.is_alive(peer.peer_id)
    poll_for(m, 6 * PERIOD)  # every later read timed out ({}): no absence is proven
    assert m.is_alive(peer.peer_id) and m.incomplete_polls > 0


def test_a_peer_missing_from_a_complete_read_leaves() -> None:
    me, peer = Identity.generate(), Identity.generate()
    m = membership(me, [record(me) | record(peer), record(me)])
    asyncio.run(m.send_heartbeat())
    asyncio.run(m.poll())
    poll_for(m, 6 * PERIOD)  # our own heartbeat is there, the peer's is not: it left
    assert not m.is_alive(peer.peer_id) and m.incomplete_polls == 0


def test_before_the_first_heartbeat_a_read_decides_nothing_is_held() -> None:
    me, peer = Identity.generate(), Identity.generate()
    m = membership(me, [record(peer), {}])
    asyncio.run(m.poll())
    assert m.is_alive(peer.peer_id)
    poll_for(m, 6 * PERIOD)
    assert not m.is_alive(peer.peer_id)  # nothing sent yet: a read missing us is not suspect
