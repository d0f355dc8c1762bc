"""The whole swarm at a glance (dht.swarm_pages, dht.shard_walk.walk_tree): pages partition
the peers, aggregates follow their definitions, and the observer's walk of the shard tree
finds every one of 1000 peers in an in-memory DHT laid out as real nodes lay it out."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dashboard.view import merged_everywhere
from dht.grouping import GroupingPolicy, MembershipView
from dht.heartbeat import Heartbeat
from dht.pages import MAX_PAGE_SIZE, page_bounds
from dht.records import owner_subkey
from dht.shard_walk import SPLIT_VALUE, split_subkey, walk_tree
from dht.shards import ShardConfig, ShardTree
from dht.swarm_pages import Quantiles, summarize

RUN = "run"
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def peer_id(i: int) -> str:
    digits = ""
    while True:
        i, r = divmod(i, 58)
        digits = BASE58[r] + digits
        if not i:
            return "12D3KooW" + digits.rjust(6, "1")


@given(
    total=st.integers(0, 400),
    size=st.integers(1, 60),
    asked=st.integers(-3, 30),
)
def test_pages_partition_the_peers_and_a_page_past_the_end_is_the_last(
    total: int, size: int, asked: int
) -> None:
    first = page_bounds(total, 1, size)
    pages = [page_bounds(total, n, size) for n in range(1, first.pages + 1)]
    covered = [i for p in pages for i in range(p.start, p.stop)]
    assert covered == list(range(total))  # every peer on exactly one page, in order
    assert all(0 < p.stop - p.start <= size for p in pages) or total == 0
    assert first.pages == max(1, -(-total // size))
    clamped = page_bounds(total, asked, size)
    assert clamped.number == min(max(asked, 1), first.pages)
    assert (clamped.start, clamped.stop) == (
        pages[clamped.number - 1].start,
        pages[clamped.number - 1].stop,
    )


@pytest.mark.parametrize("size", [0, -1, MAX_PAGE_SIZE + 1])
def test_a_page_size_out_of_range_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match="a page holds"):
        page_bounds(10, 1, size)


@given(st.lists(st.floats(0, 20, allow_nan=False), max_size=50))
def test_quantiles_are_nearest_rank_over_the_sorted_values(values: list[float]) -> None:
    q = Quantiles.of(values)
    if not values:
        assert q is None
        return
    assert q is not None and q.count == len(values)
    assert q.values[0.0] == min(values) and q.values[1.0] == max(values)
    ordered = sorted(values)
    assert q.values[0.5] == ordered[round(0.5 * (len(values) - 1))]
    assert q.values[0.1] <= q.values[0.5] <= q.values[0.9]


def test_summary_counts_states_learners_groups_and_loss() -> None:
    ids = [peer_id(i) for i in range(40)]
    beats = [
        Heartbeat(
            peer_id=p,
            state="idle" if i < 5 else "syncing" if i < 8 else "training",
            loss=float(i),
            round=i,
            # the first 30 peers had an update merged somewhere; the others none yet
            merged_by_author={ids[(i + 1) % 30]: 2},
        )
        for i, p in enumerate(ids)
    ]
    s = summarize(RUN, beats, {"1": 20, "0": 20})
    assert s.peers == 40
    assert s.states == {"syncing": 3, "training": 32, "idle": 5}
    assert s.learners == 30 - 5  # contributed and not idle
    grouping = GroupingPolicy(RUN).decide(MembershipView.of(0, ids))
    assert (s.groups, s.group_bits) == (grouping.num_learners, grouping.bits) == (4, 2)
    assert s.loss is not None and s.loss.values[0.0] == 0.0 and s.loss.values[1.0] == 39.0
    assert s.val_loss is None
    assert s.shards == {"0": 20, "1": 20}


@given(
    st.lists(st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 5), max_size=6), max_size=6)
)
def test_merged_everywhere_is_the_minimum_over_every_replica(
    counts: list[dict[str, int]],
) -> None:
    """The one-pass count equals its definition: min over replicas, 0 where one lacks it."""
    replicas = [Heartbeat(peer_id=peer_id(i), merged_by_author=c) for i, c in enumerate(counts)]
    fast = merged_everywhere(replicas)
    for author in "abcdef":
        naive = min((c.get(author, 0) for c in counts), default=0)
        assert fast.get(author, 0) == naive


def in_memory_dht(tree: ShardTree, rng: random.Random) -> dict[str, dict[object, object]]:
    """Shard prefix -> records, as real nodes leave them: each leaf holds its peers'
    heartbeats, each split key a few marks of peers under it, and some junk anywhere."""
    records: dict[str, dict[object, object]] = {}
    for leaf in tree.leaves():
        peers = sorted(tree.peers_in(leaf))
        records.setdefault(leaf, {}).update({owner_subkey(p): f"beat {p}" for p in peers})
        for depth in range(len(leaf)):
            marker = rng.choice(peers) if peers else None
            if marker is not None:
                records.setdefault(leaf[:depth], {})[split_subkey(marker)] = SPLIT_VALUE
    records.setdefault("", {})["junk"] = "not an owner subkey"
    return records


def test_the_observer_walk_finds_each_of_1000_peers_once_in_their_leaves() -> None:
    rng = random.Random(5)
    tree = ShardTree(RUN, ShardConfig())
    ids = [peer_id(i) for i in range(1000)]
    for p in ids:
        tree.add(p)
    dht = in_memory_dht(tree, rng)
    reads: list[str] = []

    def read_key(prefix: str) -> dict[object, object]:
        reads.append(prefix)
        return dht.get(prefix, {})

    walk = walk_tree(RUN, read_key, max_keys=4096, max_depth=ShardConfig().max_depth)

    found = [str(s) for s, _ in walk.records if s != "junk"]
    assert sorted(found) == sorted(owner_subkey(p) for p in ids)
    assert walk.leaves == {leaf: n for leaf, n in tree.leaves().items() if n}
    assert max(walk.leaves.values()) <= ShardConfig().max_records
    assert len(reads) == len(set(reads)) == len(dht)  # each key once; N / 32 leaves + splits
    assert len(walk.leaves) >= 1000 // ShardConfig().max_records
    assert not walk.truncated
    assert ("junk", "not an owner subkey") in walk.records  # the caller counts it rejected

    capped = walk_tree(RUN, lambda p: dht.get(p, {}), max_keys=5, max_depth=24)
    assert capped.truncated and len(capped.leaves) < len(walk.leaves)
