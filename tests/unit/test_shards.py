"""Heartbeat shards: every peer stays readable and no key holds more than its bound."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import peer_bits
from dht.shards import ShardConfig, ShardTree, shard_key

PEERS = [f"12D3KooWpeer{i:04d}" for i in range(600)]
CONFIG = ShardConfig(max_records=8, merge_below=0.25)
operations = st.lists(st.tuples(st.booleans(), st.sampled_from(PEERS)), max_size=300)


def _check(tree: ShardTree, present: set[str]) -> None:
    leaves = tree.leaves()
    # the leaves partition the position space: prefix-free and complete
    assert sum(2.0 ** -len(prefix) for prefix in leaves) == 1.0
    assert sum(leaves.values()) == len(present) == len(tree)
    for prefix, count in leaves.items():
        assert count <= tree.config.max_records or len(prefix) == tree.config.max_depth
    for peer in present:
        leaf = tree.leaf_of(peer)
        assert peer in tree.peers_in(leaf)
        assert tree.read_path(peer)[-1] == shard_key(leaf)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_joins_and_leaves_keep_every_peer_readable_and_every_key_bounded(
    ops: list[tuple[bool, str]],
) -> None:
    tree, present = ShardTree("run-a", CONFIG), set()
    for joins, peer in ops:
        if joins:
            tree.add(peer)
            present.add(peer)
        else:
            tree.remove(peer)
            present.discard(peer)
    _check(tree, present)


def test_shards_split_as_the_swarm_grows_and_merge_as_it_empties() -> None:
    tree = ShardTree("run-a", ShardConfig(max_records=32))
    for peer in PEERS[:600]:
        tree.add(peer)
    leaves = tree.leaves()
    assert len(leaves) >= 600 // 32 and max(leaves.values()) <= 32
    for peer in PEERS[:598]:
        tree.remove(peer)
    assert tree.leaves() == {"": 2}


def test_a_shard_that_just_split_does_not_merge_on_the_next_leave() -> None:
    tree = ShardTree("run-a", CONFIG)
    peers = PEERS[:9]
    for peer in peers:
        tree.add(peer)
    split = tree.leaves()
    assert len(split) >= 2
    tree.remove(peers[0])
    assert len(tree.leaves()) == len(split)


@settings(max_examples=40, deadline=None)
@given(st.sets(st.sampled_from(PEERS), min_size=1, max_size=200), st.integers(0, 6))
def test_a_groups_members_are_all_in_the_leaves_that_cover_its_prefix(
    peers: set[str], bits: int
) -> None:
    tree = ShardTree("run-a", CONFIG)
    for peer in peers:
        tree.add(peer)
    group = peer_bits("run-a", min(peers))[:bits]
    members = {p for p in peers if peer_bits("run-a", p).startswith(group)}
    leaves = tree.covering(group)
    held = set().union(*(tree.peers_in(leaf) for leaf in leaves))
    if len(leaves) == 1 and len(leaves[0]) <= bits:  # one shard above the group: its bound
        assert members <= held and len(held) <= CONFIG.max_records
    else:  # the group spans shards below its prefix: exactly its members
        assert held == members


def test_a_sample_is_bounded_whatever_the_swarm() -> None:
    tree = ShardTree("run-a", CONFIG)
    for peer in PEERS:
        tree.add(peer)
    assert len(tree.sample(random.Random(0), 4)) == 4


@pytest.mark.parametrize(
    "kwargs", [{"max_records": 1}, {"merge_below": 0.6}, {"max_depth": 65}, {"max_records": 2.5}]
)
def test_bad_shard_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be"):
        ShardConfig(**kwargs)  # type: ignore[arg-type]
