"""Heartbeats under sharded DHT keys: what one node writes and reads per period.

The decisions are dht.shard_walk's (pure); this module does the DHT calls. Per heartbeat
period a node writes its heartbeat to its leaf's key, the split marks it is due to refresh
(a few per swarm, see dht.shard_walk) and, now and then, the run record; per poll it reads
its leaf (plus its sibling and parent when the leaf is sparse and may merge), and once per
heartbeat period ``SAMPLE_SHARDS`` random shards for a view of the rest of the swarm. What
it reads does not grow with the swarm: at most ``max_records`` heartbeats and a few marks
per key.

The single key of earlier versions (``PREFIX/peers``) is still read during a transition: at
every poll while it held another peer's record, else once every ``LEGACY_EVERY`` heartbeat
periods (an empty key costs one lookup and no records). While it holds a peer this node has
not found in any shard for three periods (a node of an earlier version, which reads only that
key), this node writes its heartbeat there too, so the old node sees it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dht.grouping import peer_bits
from dht.grouping_view import group_walker
from dht.network import SwarmNetwork
from dht.records import owner_subkey, subkey_owner
from dht.shard_walk import (
    MARK_WRITERS,
    SPLIT_VALUE,
    ShardCursor,
    ShardRead,
    Step,
    adjust_sample,
    parse_shard,
    split_subkey,
)
from dht.shards import shard_key

SAMPLE_SHARDS = 2
"""Random shards read per heartbeat period beside this node's own."""
SAMPLE_STEPS = 8
"""Keys one sample reads at most: in an even tree the first is a leaf; in an uneven one
(a small swarm) the walk goes up from empty keys to a populated one."""
LEGACY_EVERY = 4
"""Heartbeat periods between reads of an empty legacy key."""


@dataclass
class ShardPoll:
    """What one poll read, for dht.membership to verify and judge."""

    records: dict[Any, Any] = field(default_factory=dict)
    """Owner subkey -> heartbeat blob (and unsorted records, for counting), every key read."""
    own_found: bool = False
    """This node's heartbeat was in its leaf (the read was complete)."""
    moved: bool = False
    """This node's leaf changed during the poll: its heartbeat was not there yet."""
    leaves: list[str] = field(default_factory=list)
    """Leaf prefixes read: a peer under one of them and not in `records` is absent."""
    shard_peers: set[str] = field(default_factory=set)
    """Peers whose heartbeat was in a shard read."""
    legacy_read: bool = False
    legacy_peers: set[str] = field(default_factory=set)
    """Peers whose heartbeat was in the legacy key (when it was read)."""


class HeartbeatShards:
    """This node's heartbeat shard: where it writes, what it reads, and how much."""

    def __init__(self, network: SwarmNetwork, peer_id: str, rng: random.Random | None = None):
        self.network = network
        self.config = network.config
        self.peer_id = peer_id
        self.cursor = ShardCursor(self.config.run_id, peer_id, self.config.shards)
        self._rng = rng or random.Random()
        self._merging = False
        self._last_sample = float("-inf")
        self._last_legacy = float("-inf")
        self._legacy_busy = True
        """The legacy key held another peer's record at its last read (read it every poll)."""
        self._in_shards: dict[str, float] = {}
        """Peer -> when it was last found in a shard (bounded by the peers seen in 3 periods)."""
        self._old_seen_at = float("-inf")
        """When the legacy key last held a peer not found in any shard: an old node."""
        self.group_prefix: str | None = None
        """This node's learner group (docs/scale.md): when set, each poll also reads the
        shard keys holding the group's heartbeats. None (today's nodes): it reads none."""
        self.keys_read = 0
        self.records_read = 0
        """DHT keys read and records (subkeys) they returned, since start: the figures
        `bench.scale_heartbeats` reports per second."""

    def key(self, prefix: str) -> str:
        return f"{self.config.prefix}/{shard_key(prefix)}"

    @property
    def legacy_key(self) -> str:
        return f"{self.config.prefix}/peers"

    @property
    def compat(self) -> bool:
        """Whether this node also writes the legacy key (an old node was seen lately)."""
        return time.time() - self._old_seen_at < 3 * self.config.heartbeat_period_s

    def estimated_swarm(self) -> int:
        return self.cursor.leaf_count * 2**self.cursor.depth

    async def store(self, blob: bytes, ttl_s: float, *, run_record: bool) -> bool:
        """Writes this node's heartbeat and its share of marks; whether the run record is due
        (always on the first heartbeat, then by about MARK_WRITERS peers per period)."""
        await self.network.dht_store(
            self.key(self.cursor.prefix), owner_subkey(self.peer_id), blob, ttl_s
        )
        for prefix in self.cursor.marks_to_refresh(self._rng, merging=self._merging):
            await self.network.dht_store(
                self.key(prefix), split_subkey(self.peer_id), SPLIT_VALUE, ttl_s
            )
        if self.compat:
            await self.network.dht_store(self.legacy_key, owner_subkey(self.peer_id), blob, ttl_s)
        return run_record or self._rng.random() < MARK_WRITERS / self.estimated_swarm()

    async def read(self, *, sent: bool, ttl_s: float) -> ShardPoll:
        """One poll: this node's leaf (walking to it), then the sample and the legacy key
        when due. `sent`: this node has stored a heartbeat (so its leaf must hold it)."""
        poll = ShardPoll()
        now, period = time.time(), self.config.heartbeat_period_s
        own = await self._walk(poll, ttl_s)
        poll.own_found = self.peer_id in own.heartbeats or not sent
        if self.group_prefix is not None:
            await self._read_group(poll, self.group_prefix)
        if now - self._last_sample >= period:
            self._last_sample = now
            for _ in range(SAMPLE_SHARDS):
                await self._read_sample(poll)
        if self._legacy_busy or now - self._last_legacy >= LEGACY_EVERY * period:
            self._last_legacy = now
            await self._read_legacy(poll, now)
        return poll

    async def _get(self, key: str) -> dict[Any, Any]:
        records = await self.network.dht_get(key)
        self.keys_read += 1
        self.records_read += len(records)
        return records

    async def _read_shard(self, prefix: str) -> tuple[ShardRead, Mapping[Any, Any]]:
        records = await self._get(self.key(prefix))
        return parse_shard(self.config.run_id, prefix, records), records

    async def _walk(self, poll: ShardPoll, ttl_s: float) -> ShardRead:
        """Reads this node's leaf, following marks down or a merge up (bounded steps)."""
        cursor = self.cursor
        for _ in range(cursor.config.max_depth + 2):
            read, records = await self._read_shard(cursor.prefix)
            sibling = parent = None
            self._merging = cursor.wants_sibling(read)
            if self._merging and cursor.sibling is not None:
                sibling, _ = await self._read_shard(cursor.sibling)
                self._merging = cursor.merges_with(read, sibling)
                if self._merging:
                    parent, _ = await self._read_shard(cursor.prefix[:-1])
            before = cursor.prefix
            step = cursor.step(read, sibling=sibling, parent=parent)
            if step is Step.STAY:
                self._take(poll, read, records, own=True)
                return read
            poll.moved = True
            self._merging = False
            if step is Step.SPLIT:
                await self.network.dht_store(
                    self.key(before), split_subkey(self.peer_id), SPLIT_VALUE, ttl_s
                )
        self._take(poll, read, records, own=True)
        return read

    async def _read_group(self, poll: ShardPoll, prefix: str) -> None:
        """The keys under this node's group prefix, when its own leaf lies below the prefix
        (else that leaf, read already, holds the whole group)."""
        walker = group_walker(self.config.run_id, prefix, self.cursor.depth, self.cursor.config)
        while walker is not None and (key := walker.next_key()) is not None:
            records = await self._get(self.key(key))
            self._take(poll, walker.take(key, records), records)

    async def _read_sample(self, poll: ShardPoll) -> None:
        position = format(self._rng.getrandbits(64), "064b")
        prefix: str | None = position[: self.cursor.depth]
        empty: set[str] = set()
        for _ in range(SAMPLE_STEPS):  # the sampled key, then steps down or up to a leaf
            if prefix is None or prefix == self.cursor.prefix:
                return
            read, records = await self._read_shard(prefix)
            self._take(poll, read, records)
            prefix = adjust_sample(read, position, self.cursor.config.max_depth, empty)

    def _take(
        self, poll: ShardPoll, read: ShardRead, records: Mapping[Any, Any], own: bool = False
    ) -> None:
        """Adds a read's records to the poll. This node's own leaf proves absences even when
        empty (an incomplete read is caught by its own heartbeat's absence); a sampled key only
        when it is a leaf with heartbeats (an empty one may have merged into its parent)."""
        now = time.time()
        for owner in read.heartbeats:
            poll.records[owner_subkey(owner)] = read.heartbeats[owner]
            poll.shard_peers.add(owner)
            self._in_shards[owner] = now
        poll.records.update(read.junk)
        if read.is_leaf or (own and not read.marks):
            poll.leaves.append(read.prefix)

    async def _read_legacy(self, poll: ShardPoll, now: float) -> None:
        records = await self._get(self.legacy_key)
        poll.legacy_read = True
        period = self.config.heartbeat_period_s
        self._in_shards = {p: t for p, t in self._in_shards.items() if now - t < 3 * period}
        others = 0
        for subkey, blob in records.items():
            owner = subkey_owner(subkey)
            if owner == self.peer_id:
                continue
            others += 1
            poll.records.setdefault(subkey, blob)
            if owner is not None:
                poll.legacy_peers.add(owner)
                if owner not in self._in_shards:
                    self._old_seen_at = now
        self._legacy_busy = others > 0

    def position(self, peer_id: str) -> str:
        return peer_bits(self.config.run_id, peer_id)
