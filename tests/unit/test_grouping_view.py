"""Learner groups from the heartbeat shards (dht.grouping_view; docs/scale.md wiring plan steps
1-2): the epoch's grouping agrees on every replica fed the same views and changes only
between epochs; a replica whose first census was partial follows the bits its peers announce
(never more than its own census bears); a member reading its group's shard keys finds exactly
its group, within bounded reads; in-memory members with their group set see their group."""

from __future__ import annotations

import asyncio
import itertools
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import GroupingConfig, peer_bits
from dht.grouping_view import (
    EpochGrouping,
    group_members,
    group_prefix,
    group_walker,
    merged,
)
from dht.heartbeat import Heartbeat
from dht.membership import Membership
from dht.records import owner_subkey, subkey_owner
from dht.rejections import Rejections
from dht.shard_walk import SPLIT_VALUE, split_subkey
from dht.shards import ShardConfig, ShardTree
from dht.swarm_config import SwarmConfig
from merge.identity import Identity
from tests.unit.test_membership_shards import PERIOD, Keys
from tests.unit.test_swarm_pages import peer_id

RUN = "run"

views = st.lists(
    st.tuples(st.integers(0, 3), st.frozensets(st.integers(0, 400), max_size=120)),
    min_size=1,
    max_size=12,
)


@given(views=views, epoch_rounds=st.integers(1, 5))
def test_replicas_fed_the_same_views_agree_and_groups_change_only_between_epochs(
    views: list[tuple[int, frozenset[int]]], epoch_rounds: int
) -> None:
    config = GroupingConfig(min_group_size=4)
    # patience 0: a fall is not deferred past the epoch's first round (dht.grouping_split)
    a = EpochGrouping(RUN, epoch_rounds, config, patience=0)
    b = EpochGrouping(RUN, epoch_rounds, config, patience=0)
    round_, last = 0, None
    for step, members in views:
        round_ += step
        peers = [peer_id(i) for i in members]
        was_due = a.due(round_)
        decided = a.decide(round_, peers)
        assert decided is not None  # nobody announces a split: nothing to wait for
        assert decided == b.decide(round_, list(reversed(peers)))  # order does not matter
        assert decided.epoch == round_ // epoch_rounds
        if not was_due and last is not None and decided.bits == last.bits:
            # within an epoch the first decision stands, unless peers read since grow its
            # groups or change which are merged (dht.grouping.MIN_MEMBERS); lists only grow
            if decided is not last:
                listed = {p for ps in last.members.values() for p in ps}
                assert set(peers) - listed
                now = {p for ps in decided.members.values() for p in ps}
                if merged(decided) or merged(last):
                    assert now == listed | set(peers)
                else:  # the same groups, each grown by the peers of it read since
                    assert set(decided.members) == set(last.members)
                    for key, group in last.members.items():
                        prefix = key.removeprefix("groups.0b")
                        grown = {p for p in set(peers) if peer_bits(RUN, p).startswith(prefix)}
                        assert set(decided.members[key]) == set(group) | grown
        elif not was_due and last is not None:  # ... unless the census grew past a split
            assert decided.bits > last.bits
        else:  # a new epoch: decided from this view
            assert sorted(p for ps in decided.members.values() for p in ps) == sorted(set(peers))
        assert not a.due(round_)
        last = decided


def test_epoch_rounds_must_be_a_positive_integer() -> None:
    with pytest.raises(ValueError, match="epoch_rounds"):
        EpochGrouping(RUN, 0)


@given(
    n=st.integers(1, 300),
    bits=st.integers(0, 5),
    max_records=st.integers(2, 8),
    seed=st.integers(0, 1000),
)
@settings(max_examples=60, deadline=None)
def test_a_member_reading_its_group_keys_finds_exactly_its_group(
    n: int, bits: int, max_records: int, seed: int
) -> None:
    config = ShardConfig(max_records=max_records)
    tree = ShardTree(RUN, config)
    ids = [peer_id(i) for i in range(n)]
    for p in ids:
        tree.add(p)
    rng = random.Random(seed)
    dht: dict[str, dict[object, object]] = {}
    for leaf in tree.leaves():
        peers = sorted(tree.peers_in(leaf))
        dht.setdefault(leaf, {}).update({owner_subkey(p): b"beat" for p in peers})
        for depth in range(len(leaf)):
            if peers:
                dht.setdefault(leaf[:depth], {})[split_subkey(rng.choice(peers))] = SPLIT_VALUE
    me = rng.choice(ids)
    prefix = group_prefix(RUN, me, bits)
    group = {p for p in ids if peer_bits(RUN, p).startswith(prefix)}
    leaf = tree.leaf_of(me)

    walker = group_walker(RUN, prefix, len(leaf), config)
    if walker is None:  # its own leaf holds the whole group
        found = {subkey_owner(s) for s in dht[leaf]} - {None}
        assert group <= found and len(found) <= max_records
        return
    keys = 0
    while (key := walker.next_key()) is not None:
        walker.take(key, dht.get(key, {}))
        keys += 1
    walk = walker.result()
    assert {subkey_owner(s) for s, _ in walk.records} == group  # nobody else, nobody missing
    below = [leaf for leaf in tree.leaves() if leaf.startswith(prefix)]
    assert keys <= 2 * len(below)  # the leaves and the split keys above them
    assert not walk.truncated and group_members(RUN, prefix, ids) == sorted(group)


@given(st.sets(st.integers(0, 500), max_size=80), st.integers(0, 5))
def test_groups_partition_the_live_peers(members: set[int], bits: int) -> None:
    ids = [peer_id(i) for i in members]
    prefixes = ["".join(b) for b in itertools.product("01", repeat=bits)]
    groups = [group_members(RUN, prefix, ids) for prefix in prefixes]
    assert sorted(p for g in groups for p in g) == sorted(ids)


def test_members_with_their_group_set_see_their_whole_group_without_samples() -> None:
    """Eight in-memory members, shards of 2, no random samples: with its group (1 bit) set,
    every member's live peers include its whole group (peers seen earlier elsewhere stay
    alive until a read of their own leaf misses them, as without groups)."""
    config = SwarmConfig(
        run_id=RUN, fingerprint="f" * 64, run_summary={}, identity_path="",
        heartbeat_period_s=PERIOD, shards=ShardConfig(max_records=2),
    )  # fmt: skip
    keys = Keys(config)
    members = []
    for me in (Identity.generate() for _ in range(8)):
        m = Membership(
            keys,  # type: ignore[arg-type]
            me,
            heartbeat_fn=lambda me=me: Heartbeat(peer_id=me.peer_id, sent_at=time.time()),  # type: ignore[misc]
            reject=Rejections(lambda result: None),
            on_event=lambda *a, **k: None,
        )
        m.shards._last_sample = float("inf")  # no samples: only the own leaf and the group
        members.append(m)
    ids = [m.peer_id for m in members]
    prefix_of = {m.peer_id: group_prefix(RUN, m.peer_id, 1) for m in members}
    group_of = {p: group_members(RUN, prefix_of[p], ids) for p in ids}

    async def periods(bound: int, done: object) -> None:
        for _ in range(bound):
            for m in members:
                await m.send_heartbeat()
                await m.poll()
            if done():  # type: ignore[operator]
                return
            await asyncio.sleep(PERIOD / 2)

    # The tree splits: 8 heartbeats in keys of at most 2 need leaves below depth 1, so some
    # member's leaf lies below its group's prefix and only the group walk finds the rest.
    asyncio.run(periods(20, lambda: False))
    assert max(m.shards.cursor.depth for m in members) >= 2
    for m in members:
        m.shards.group_prefix = prefix_of[m.peer_id]

    def everyone_sees_the_group() -> bool:
        return all(m.group_peers(prefix_of[m.peer_id]) == group_of[m.peer_id] for m in members)

    asyncio.run(periods(200, everyone_sees_the_group))
    assert everyone_sees_the_group()


def test_a_replica_whose_first_census_was_partial_follows_the_announced_split() -> None:
    """min group size 3, hysteresis 0.25: six peers are one split's threshold. A replica that
    first saw four peers decided one group; held there by hysteresis (a split needs 7.5 peers)
    it would stay apart from the replicas that saw all six. The split they announce (6 peers
    bear 0 or 1 bit) lifts it (dht.grouping_split: the deepest split held in band)."""
    config = GroupingConfig(min_group_size=3)
    peers = [f"peer{i}" for i in range(6)]
    late = EpochGrouping(RUN, 1, config, me=peers[0])
    full = EpochGrouping(RUN, 1, config, me=peers[1])
    first = late.decide(0, peers[:4])
    assert first is not None and first.bits == 0
    decided = full.decide(0, peers)
    assert decided is not None and decided.bits == 1
    held = EpochGrouping(RUN, 1, config, me=peers[0])
    held.decide(0, peers[:4])
    held_next = held.decide(1, peers)
    assert held_next is not None and held_next.bits == 0  # hysteresis alone holds it
    announced = {p: 1 for p in peers[1:]}
    lifted = late.decide(1, peers, announced)
    assert lifted is not None and lifted.bits == 1
