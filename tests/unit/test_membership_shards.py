"""Membership over sharded heartbeat keys: a mixed swarm during the transition from the single
key, and absences proven only by a read of the shard that holds the peer.

The DHT is replaced by a dictionary of what each key's get returns (the input membership
decides on) that also records the stores; tests/swarm and bench.scale_heartbeats run the same
code on real hivemind DHTs.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from dht.grouping import peer_bits
from dht.heartbeat import Heartbeat
from dht.membership import Membership
from dht.records import owner_subkey
from dht.rejections import Rejections
from dht.shard_walk import SPLIT_VALUE, split_subkey
from dht.shards import ShardConfig, shard_key
from dht.swarm_config import SwarmConfig
from merge.identity import Identity
from tests.unit.skipped_clock import SkippedClock

PERIOD = 0.05
RUN = "r"


class Keys:
    """What a get of each key returns; every store is recorded (key, subkey)."""

    def __init__(self, config: SwarmConfig) -> None:
        self.config = config
        self.records: dict[str, dict[Any, Any]] = {}
        self.stores: list[tuple[str, object]] = []

    async def dht_get(self, key: str) -> dict[Any, Any]:
        return dict(self.records.get(key, {}))

    async def dht_store(self, key: str, subkey: object, value: object, ttl_s: float) -> None:
        self.stores.append((key, subkey))
        if key.startswith(self.config.prefix):
            self.records.setdefault(key, {})[subkey] = value

    def sync_dht_refusals(self) -> None:
        return None

    def shard(self, prefix: str) -> str:
        return f"{self.config.prefix}/{shard_key(prefix)}"

    @property
    def legacy(self) -> str:
        return f"{self.config.prefix}/peers"


def member(me: Identity) -> tuple[Membership, Keys]:
    config = SwarmConfig(
        run_id=RUN, fingerprint="f" * 64, run_summary={}, identity_path="",
        heartbeat_period_s=PERIOD,
    )  # fmt: skip
    keys = Keys(config)
    m = Membership(
        keys,  # type: ignore[arg-type]
        me,
        heartbeat_fn=lambda: Heartbeat(peer_id=me.peer_id, sent_at=time.time()),
        reject=Rejections(lambda result: None),
        on_event=lambda *a, **k: None,
    )
    return m, keys


def beat(identity: Identity) -> bytes:
    return Heartbeat(peer_id=identity.peer_id, sent_at=time.time()).sign(identity)


def polls(m: Membership, seconds: float, clock: SkippedClock) -> None:
    """A heartbeat and a poll every half period for `seconds` of the test's clock."""
    for _ in range(round(seconds / (PERIOD / 2))):
        clock.skip(PERIOD / 2)
        asyncio.run(m.send_heartbeat())
        asyncio.run(m.poll())


def test_a_node_of_an_earlier_version_is_read_from_the_single_key_and_sees_us_there(
    clock: SkippedClock,
) -> None:
    me, old = Identity.generate(), Identity.generate()
    m, keys = member(me)
    keys.records[keys.legacy] = {owner_subkey(old.peer_id): beat(old)}
    asyncio.run(m.send_heartbeat())
    assert (keys.legacy, owner_subkey(me.peer_id)) not in keys.stores  # no old node seen yet
    asyncio.run(m.poll())
    assert m.is_alive(old.peer_id) and m.shards.compat
    keys.stores.clear()
    polls(m, 6 * PERIOD, clock)  # the old node keeps writing its heartbeat ...
    keys.records[keys.legacy][owner_subkey(old.peer_id)] = beat(old)
    assert (keys.legacy, owner_subkey(me.peer_id)) in keys.stores  # ... and we write ours there
    assert (keys.shard(""), owner_subkey(me.peer_id)) in keys.stores
    del keys.records[keys.legacy][owner_subkey(old.peer_id)]
    polls(m, 6 * PERIOD, clock)  # a read of the single key misses it: it left
    assert not m.is_alive(old.peer_id)


def test_a_new_node_that_also_writes_the_single_key_does_not_keep_us_writing_it() -> None:
    me, new = Identity.generate(), Identity.generate()
    m, keys = member(me)
    keys.records[keys.shard("")] = {owner_subkey(new.peer_id): beat(new)}
    keys.records[keys.legacy] = {owner_subkey(new.peer_id): beat(new)}
    asyncio.run(m.send_heartbeat())
    asyncio.run(m.poll())
    assert m.is_alive(new.peer_id) and not m.shards.compat


def _one_in(shard: str) -> Identity:
    """A fresh identity whose position starts with `shard` (one bit)."""
    return next(
        i
        for i in (Identity.generate() for _ in range(64))
        if peer_bits(RUN, i.peer_id)[:1] == shard
    )


def _seen_across_a_split(*, sent: bool) -> tuple[Membership, Keys, Identity, str]:
    """A member in its own leaf after a split at the root that has read, by a sample, a peer
    of the other leaf: (membership, keys, that peer, its shard). `sent`: a heartbeat stored
    before the first poll."""
    me = Identity.generate()
    mine = peer_bits(RUN, me.peer_id)[:1]
    theirs = "1" if mine == "0" else "0"
    other = _one_in(theirs)
    m, keys = member(me)
    keys.records[keys.shard("")] = {split_subkey(other.peer_id): SPLIT_VALUE}  # split at root
    keys.records[keys.shard(theirs)] = {owner_subkey(other.peer_id): beat(other)}
    if sent:
        asyncio.run(m.send_heartbeat())
    asyncio.run(m.poll())  # walks down to its own leaf
    assert m.shards.cursor.prefix == mine
    for _ in range(40):  # sampled until the other shard is read once
        if m.is_alive(other.peer_id):
            break
        m.shards._last_sample = 0.0
        asyncio.run(m.poll())
    assert m.is_alive(other.peer_id)
    return m, keys, other, theirs


def test_a_peer_in_another_shard_stays_alive_until_a_read_of_its_shard_misses_it(
    clock: SkippedClock,
) -> None:
    m, keys, other, theirs = _seen_across_a_split(sent=False)
    keys.records[keys.shard(theirs)] = {}  # read no more: nothing proves it gone
    m.shards._last_sample = float("inf")
    polls(m, 6 * PERIOD, clock)
    assert m.is_alive(other.peer_id)
    third = _one_in(theirs)
    for _ in range(20):  # its shard is read (sampled) and holds another peer, not it
        clock.skip(PERIOD / 2)
        keys.records[keys.shard(theirs)] = {owner_subkey(third.peer_id): beat(third)}
        m.shards._last_sample = 0.0
        asyncio.run(m.send_heartbeat())
        asyncio.run(m.poll())
    assert m.is_alive(third.peer_id) and not m.is_alive(other.peer_id)


def test_in_tiny_shards_every_members_view_fills_in_through_samples() -> None:
    config = SwarmConfig(
        run_id=RUN, fingerprint="f" * 64, run_summary={}, identity_path="",
        heartbeat_period_s=PERIOD, shards=ShardConfig(max_records=2),
    )  # fmt: skip
    keys = Keys(config)
    members = []
    for me in (Identity.generate() for _ in range(6)):
        members.append(
            Membership(
                keys,  # type: ignore[arg-type]
                me,
                heartbeat_fn=lambda me=me: Heartbeat(peer_id=me.peer_id, sent_at=time.time()),
                reject=Rejections(lambda result: None),
                on_event=lambda *a, **k: None,
            )
        )

    async def periods(bound: int) -> None:
        for _ in range(bound):
            for m in members:
                await m.send_heartbeat()
                await m.poll()
            if all(len(m.alive_peers()) == 5 for m in members):
                return
            await asyncio.sleep(PERIOD / 2)

    asyncio.run(periods(400))
    assert max(m.shards.cursor.depth for m in members) >= 1  # the root split
    assert [len(m.alive_peers()) for m in members] == [5] * 6


def test_a_peer_in_another_shard_that_one_read_missed_expires_without_more_samples(
    clock: SkippedClock,
) -> None:
    """One complete read of its shard without it is the proof; the reads after it that cover
    only this node's own shard do not hold it alive again (they did: a dead peer elsewhere
    stayed alive until samples covered its shard three periods in a row)."""
    m, keys, other, theirs = _seen_across_a_split(sent=True)
    third = _one_in(theirs)
    keys.records[keys.shard(theirs)] = {owner_subkey(third.peer_id): beat(third)}
    for _ in range(40):  # sampled until its shard is read without it, once
        clock.skip(PERIOD / 10)
        m.shards._last_sample = 0.0
        asyncio.run(m.poll())
        if m.is_alive(third.peer_id):
            break
    assert m.is_alive(third.peer_id) and m.is_alive(other.peer_id)  # not yet expired
    m.shards._last_sample = float("inf")  # from now on only its own shard is read
    polls(m, 4 * PERIOD, clock)
    assert not m.is_alive(other.peer_id)
