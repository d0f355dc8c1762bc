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
from dht.records import owner_subkey
from dht.rejections import Rejections
from dht.swarm_config import SwarmConfig
from merge.identity import Identity
from tests.unit.skipped_clock import SkippedClock

PERIOD = 0.05


class Reads:
    """What each dht_get returns, in turn (the last one repeats)."""

    def __init__(self, config: SwarmConfig, reads: list[dict[Any, Any]]) -> None:
        self.config, self.reads = config, reads

    async def dht_get(self, key: str) -> dict[Any, Any]:
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]

    async def dht_store(self, *args: Any) -> None:
        return None

    def sync_dht_refusals(self) -> None:
        return None


def membership(
    me: Identity, reads: list[dict[Any, Any]], events: list[tuple[str, str]] | None = None
) -> Membership:
    noted = [] if events is None else events
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
        on_event=lambda name, **k: noted.append((name, k["peer_id"])),
    )


def record(identity: Identity) -> dict[str, bytes]:
    return {owner_subkey(identity.peer_id): Heartbeat(peer_id=identity.peer_id).sign(identity)}


def poll_for(m: Membership, seconds: float, clock: SkippedClock) -> None:
    """A poll every half period for `seconds` of the test's clock."""
    for _ in range(round(seconds / (PERIOD / 2))):
        clock.skip(PERIOD / 2)
        asyncio.run(m.poll())


def test_a_peer_stays_alive_while_reads_miss_our_own_heartbeat(clock: SkippedClock) -> None:
    me, peer = Identity.generate(), Identity.generate()
    m = membership(me, [record(me) | record(peer), {}])
    asyncio.run(m.send_heartbeat())
    asyncio.run(m.poll())
    assert m.is_alive(peer.peer_id)
    poll_for(m, 6 * PERIOD, clock)  # every later read timed out ({}): no absence is proven
    assert m.is_alive(peer.peer_id) and m.incomplete_polls > 0


def test_a_peer_missing_from_a_complete_read_leaves(clock: SkippedClock) -> None:
    me, peer = Identity.generate(), Identity.generate()
    m = membership(me, [record(me) | record(peer), record(me)])
    asyncio.run(m.send_heartbeat())
    asyncio.run(m.poll())
    poll_for(m, 6 * PERIOD, clock)  # our own heartbeat is there, the peer's is not: it left
    assert not m.is_alive(peer.peer_id) and m.incomplete_polls == 0


def test_before_the_first_heartbeat_a_read_decides_nothing_is_held(clock: SkippedClock) -> None:
    me, peer = Identity.generate(), Identity.generate()
    m = membership(me, [record(peer), {}])
    asyncio.run(m.poll())
    assert m.is_alive(peer.peer_id)
    poll_for(m, 6 * PERIOD, clock)
    assert not m.is_alive(peer.peer_id)  # nothing sent yet: a read missing us is not suspect


class SlowReads(Reads):
    """Every read takes `delay_s` (a peers record that ~1,000 Sybil heartbeats fill) and finds
    a fresh heartbeat of each of `live`."""

    def __init__(
        self,
        config: SwarmConfig,
        live: list[Identity],
        delay_s: float,
        clock: SkippedClock | None = None,
    ) -> None:
        super().__init__(config, [{}])
        self.live, self.delay_s, self.clock = live, delay_s, clock

    async def dht_get(self, key: str) -> dict[Any, Any]:
        await asyncio.sleep(self.delay_s)
        if self.clock is not None:  # the test's clock, frozen otherwise, moves by the delay
            self.clock.skip(self.delay_s)
        return {
            owner_subkey(i.peer_id): Heartbeat(peer_id=i.peer_id, sent_at=time.time()).sign(i)
            for i in self.live
        }


def use(m: Membership, reads: Reads) -> None:
    """Every later read of `m` (its heartbeat shards' included) goes to `reads`."""
    m.network = m.shards.network = reads  # type: ignore[assignment]


def test_a_peer_found_by_every_slow_read_stays_alive_during_the_next_one() -> None:
    me, peer = Identity.generate(), Identity.generate()
    m = membership(me, [record(me) | record(peer)])
    use(m, SlowReads(m.config, [me, peer], 4 * PERIOD))
    asyncio.run(m.send_heartbeat())
    asyncio.run(m.poll())

    async def watch_during_reads() -> list[bool]:
        seen: list[bool] = []
        for _ in range(3):
            read = asyncio.ensure_future(m.poll())
            while not read.done():
                seen.append(m.is_alive(peer.peer_id) and len(m.alive_peers()) == 1)
                await asyncio.sleep(PERIOD / 4)
            await read
        return seen

    # Each read lasts more than three periods: judged by the wall clock while it is in
    # flight, the peer would look silent; nothing proves it gone before a read returns.
    seen = asyncio.run(watch_during_reads())
    assert seen and all(seen)
    assert m.is_alive(peer.peer_id)


def test_a_slow_read_that_misses_a_peer_proves_it_gone_only_after_it_returns(
    clock: SkippedClock,
) -> None:
    me, peer = Identity.generate(), Identity.generate()
    m = membership(me, [record(me) | record(peer)])
    asyncio.run(m.send_heartbeat())
    asyncio.run(m.poll())
    clock.skip(PERIOD)
    use(m, SlowReads(m.config, [me], 3 * PERIOD, clock))

    async def one_read() -> tuple[bool, bool]:
        read = asyncio.ensure_future(m.poll())
        await asyncio.sleep(PERIOD)
        during = m.is_alive(peer.peer_id)  # the read has not returned: nothing proven yet
        await read
        return during, m.is_alive(peer.peer_id)

    during, after = asyncio.run(one_read())
    assert during and not after


def seen_once(me: Identity, peer: Identity) -> tuple[Membership, list[tuple[str, str]]]:
    """A membership that sent its heartbeat and read `peer`'s once; its peer events."""
    events: list[tuple[str, str]] = []
    m = membership(me, [{}], events)
    use(m, SlowReads(m.config, [me, peer], 0.0))
    asyncio.run(m.send_heartbeat())
    asyncio.run(m.poll())
    return m, events


def test_a_node_whose_own_loop_stalls_drops_no_peer_and_sees_no_rejoin(clock: SkippedClock) -> None:
    """Session 18, 16 nodes on 2 cores: views flapped in bursts (up to 14 peers left at once
    and joined again seconds later) when a node's loop stalled past three periods between
    two reads. Nothing proves a peer gone but a read that returned without it."""
    me, peer = Identity.generate(), Identity.generate()
    m, events = seen_once(me, peer)
    clock.skip(5 * PERIOD)  # no read for five periods: this node's loop was busy
    assert m.is_alive(peer.peer_id) and len(m.alive_peers()) == 1
    asyncio.run(m.poll())  # the peer's newer heartbeat: the same view, refreshed
    assert m.is_alive(peer.peer_id)
    assert events == [("peer_joined", peer.peer_id)]


def test_after_a_stall_a_complete_read_without_the_peer_still_proves_it_gone(
    clock: SkippedClock,
) -> None:
    me, peer = Identity.generate(), Identity.generate()
    m, events = seen_once(me, peer)
    clock.skip(5 * PERIOD)
    use(m, SlowReads(m.config, [me], 0.0))  # our own heartbeat, not the peer's: it left
    asyncio.run(m.poll())
    assert not m.is_alive(peer.peer_id)
    assert events == [("peer_joined", peer.peer_id), ("peer_left", peer.peer_id)]


def test_a_peer_that_talks_to_us_stays_alive_while_its_heartbeats_lag(clock: SkippedClock) -> None:
    """Session 19: a DHT store on a loaded machine took up to 28 s, and peers dropped a node
    whose streams reached them all along. A stream it opens or answers proves it alive."""
    me, peer, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    m, events = seen_once(me, peer)
    use(m, SlowReads(m.config, [me], 0.0))  # its heartbeat store is late: reads miss it
    for _ in range(8):
        clock.skip(PERIOD)
        m.heard_from(peer.peer_id)  # a group piece, a co-sign, a fetched answer
        m.heard_from(stranger.peer_id)  # no heartbeat ever read: adds nobody
        asyncio.run(m.poll())
    assert m.is_alive(peer.peer_id) and not m.is_alive(stranger.peer_id)
    assert events == [("peer_joined", peer.peer_id)]
    poll_for(m, 4 * PERIOD, clock)  # silent now, and still no heartbeat: it left
    m.heard_from(peer.peer_id)  # a stream after it left revives nothing
    assert not m.is_alive(peer.peer_id)
    assert events[-1] == ("peer_left", peer.peer_id)
