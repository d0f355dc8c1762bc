"""The shard walk: peers that each know only their own leaf keep every key bounded, find each
other's leaves, split when a key fills and merge back when the swarm shrinks.

The DHT is a dictionary of key -> subkey -> (value, expiry) advanced period by period: the
cursor's input is exactly what a get returns. The real-DHT wiring is measured by
bench.scale_heartbeats and covered by tests/swarm.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import peer_bits
from dht.records import owner_subkey
from dht.shard_walk import (
    SPLIT_VALUE,
    ShardCursor,
    ShardRead,
    Step,
    adjust_sample,
    covered,
    parse_shard,
    split_subkey,
)
from dht.shards import ShardConfig

RUN = "r"
TTL = 3  # periods, as a heartbeat record's


class Dht:
    def __init__(self) -> None:
        self.keys: dict[str, dict[str, tuple[object, int]]] = {}
        self.now = 0
        self.merging: dict[str, bool] = {}
        """Peer -> its leaf is about to merge (it stops refreshing its parent's mark)."""

    def store(self, prefix: str, subkey: str, value: object) -> None:
        self.keys.setdefault(prefix, {})[subkey] = (value, self.now + TTL)

    def get(self, prefix: str) -> dict[object, object]:
        live = {k: v for k, (v, exp) in self.keys.get(prefix, {}).items() if exp > self.now}
        return dict(live)


def period(dht: Dht, cursors: dict[str, ShardCursor], rng: random.Random) -> None:
    """One heartbeat period: every peer stores, then reads and walks (as membership does)."""
    merging = dht.merging
    for peer, cursor in cursors.items():
        dht.store(cursor.prefix, owner_subkey(peer), b"beat")
        for prefix in cursor.marks_to_refresh(rng, merging=merging.get(peer, False)):
            dht.store(prefix, split_subkey(peer), SPLIT_VALUE)
    for peer, cursor in cursors.items():
        for _ in range(cursor.config.max_depth + 2):
            read = parse_shard(RUN, cursor.prefix, dht.get(cursor.prefix))
            sibling = parent = None
            merging[peer] = False
            if cursor.wants_sibling(read) and cursor.sibling is not None:
                sibling = parse_shard(RUN, cursor.sibling, dht.get(cursor.sibling))
                merging[peer] = cursor.merges_with(read, sibling)
                if merging[peer]:
                    parent = parse_shard(RUN, cursor.prefix[:-1], dht.get(cursor.prefix[:-1]))
            before = cursor.prefix
            step = cursor.step(read, sibling=sibling, parent=parent)
            if step is Step.STAY:
                break
            merging[peer] = False
            if step is Step.SPLIT:
                dht.store(before, split_subkey(peer), SPLIT_VALUE)
            dht.store(cursor.prefix, owner_subkey(peer), b"beat")
    dht.now += 1


def observe(dht: Dht) -> set[str]:
    """The observer's walk: every heartbeat reachable from the root through split marks."""
    found: set[str] = set()
    pending = [""]
    while pending:
        prefix = pending.pop()
        read = parse_shard(RUN, prefix, dht.get(prefix))
        found |= set(read.heartbeats)
        if read.marks:
            pending += [prefix + "0", prefix + "1"]
    return found


def name(stem: str, i: int) -> str:
    """A peer id the owner subkeys accept (base58: no 0, O, I or l)."""
    return stem + str(i).replace("0", "z")


def swarm(n: int, config: ShardConfig, stem: str = "peer") -> dict[str, ShardCursor]:
    return {name(stem, i): ShardCursor(RUN, name(stem, i), config) for i in range(n)}


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 120), max_records=st.integers(4, 16), seed=st.integers(0, 2**16))
def test_keys_stay_bounded_and_every_peer_is_found(n: int, max_records: int, seed: int) -> None:
    config = ShardConfig(max_records=max_records)
    cursors, dht, rng = swarm(n, config), Dht(), random.Random(seed)
    for _ in range(12):
        period(dht, cursors, rng)
    for peer, cursor in cursors.items():
        read = parse_shard(RUN, cursor.prefix, dht.get(cursor.prefix))
        assert peer in read.heartbeats and read.marks == 0  # each peer sits in a live leaf
        assert len(read.heartbeats) <= max_records
    assert observe(dht) == set(cursors)
    for prefix in dht.keys:  # whatever any key holds now is bounded: heartbeats plus marks
        assert len(dht.get(prefix)) <= 2 * max_records + 16, (prefix, len(dht.get(prefix)))


def test_a_shrinking_swarm_merges_back_to_the_root() -> None:
    config = ShardConfig(max_records=16)  # siblings merge below 4 heartbeats
    cursors, dht, rng = swarm(150, config), Dht(), random.Random(1)
    for _ in range(8):
        period(dht, cursors, rng)
    assert max(c.depth for c in cursors.values()) >= 3
    survivors = {p: c for p, c in list(cursors.items())[:3]}
    for _ in range(40):
        period(dht, survivors, rng)
    assert {c.depth for c in survivors.values()} == {0}
    assert observe(dht) == set(survivors)


def test_a_growing_swarm_splits_the_root() -> None:
    config = ShardConfig(max_records=8)
    cursors, dht, rng = swarm(4, config), Dht(), random.Random(2)
    for _ in range(4):
        period(dht, cursors, rng)
    assert {c.depth for c in cursors.values()} == {0}
    cursors |= swarm(30, config, stem="Late")
    for _ in range(8):
        period(dht, cursors, rng)
    assert min(c.depth for c in cursors.values()) >= 1
    assert observe(dht) == set(cursors)


def test_marks_count_only_from_peers_under_the_key_and_junk_is_sorted_out() -> None:
    inside = next(name("p", i) for i in range(99) if peer_bits(RUN, name("p", i))[0] == "1")
    outside = next(name("p", i) for i in range(99) if peer_bits(RUN, name("p", i))[0] == "0")
    records: dict[object, object] = {
        owner_subkey(inside): b"beat",
        split_subkey(outside): SPLIT_VALUE,  # a mark from a peer elsewhere: refused
        owner_subkey(outside): b"beat",  # a heartbeat in a shard it cannot belong to
        owner_subkey(inside, "/other"): b"x",
        "no owner": b"x",
        split_subkey(inside): b"not the mark",
    }
    read = parse_shard(RUN, "1", records)
    assert set(read.heartbeats) == {inside} and read.marks == 0
    assert len(read.junk) == 5 and read.is_leaf
    assert parse_shard(RUN, "1", {split_subkey(inside): SPLIT_VALUE}).marks == 1


def marked_at(prefix: str) -> ShardRead:
    writer = next(
        name("m", i) for i in range(99) if peer_bits(RUN, name("m", i)).startswith(prefix)
    )
    return parse_shard(RUN, prefix, {split_subkey(writer): SPLIT_VALUE})


def test_a_sampled_position_steps_down_a_split_key_and_up_from_an_empty_one() -> None:
    marked = parse_shard(RUN, "", {split_subkey("a"): SPLIT_VALUE})
    assert adjust_sample(marked, "0110", 24) == "0"
    assert adjust_sample(parse_shard(RUN, "01", {}), "0110", 24) == "0"
    assert adjust_sample(parse_shard(RUN, "", {}), "0110", 24) is None
    empty: set[str] = set()
    assert adjust_sample(parse_shard(RUN, "01", {}), "0110", 24, empty) == "0"
    assert adjust_sample(marked_at("0"), "0110", 24, empty) == "00"  # not back into "01"
    empty.add("00")
    assert adjust_sample(marked_at("0"), "0110", 24, empty) is None
    assert covered("0110", ["01"]) and not covered("0110", ["1", "00"])


def test_refreshing_writers_stay_few_at_any_depth() -> None:
    rng = random.Random(0)
    cursor = ShardCursor(RUN, "me", ShardConfig(max_records=32))
    cursor.depth, cursor.leaf_count = 10, 20  # ~20,000 peers
    marks = sum(len(cursor.marks_to_refresh(rng, merging=False)) for _ in range(1000))
    assert marks < 1000 * 0.5  # each ancestor refreshed by ~4 of the peers under it
    assert cursor.marks_to_refresh(rng, merging=True).count(cursor.prefix[:-1]) == 0
