"""No learner group of a split holds fewer than MIN_MEMBERS peers (dht.grouping): a smaller
one is merged into its parent prefix, so one member can never stand alone against one other
(two complete variants of one included member each tie and void the round:
merge.group_equivocation.prevailing). The cut is a function of the view alone, so every
replica holding one view decides one grouping, in any order."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import (
    MIN_MEMBERS,
    GroupingConfig,
    GroupingPolicy,
    MembershipView,
    key_prefix,
    merged_prefixes,
    peer_bits,
)
from dht.grouping_view import EpochGrouping, merged
from merge.group_equivocation import GroupVariant, prevailing
from tests.unit.test_swarm_pages import peer_id

RUN = "run-min"
views = st.frozensets(st.integers(0, 3000), max_size=70)


def _prefix(key: str) -> str:
    prefix = key_prefix(key)
    assert prefix is not None
    return prefix


@settings(max_examples=200, deadline=None)
@given(members=views, bits=st.integers(0, 6))
def test_no_split_leaves_a_group_under_the_minimum(members: frozenset[int], bits: int) -> None:
    """At any split (the agreed `bits`), every group holds MIN_MEMBERS peers or more, unless
    the whole view is one group; every peer is in exactly one group, whose prefix starts its
    position and is no deeper than the split."""
    peers = [peer_id(i) for i in members]
    grouping = GroupingPolicy(RUN).at_bits(MembershipView.of(0, peers), bits)
    groups = grouping.members
    if len(groups) > 1:
        assert min(len(m) for m in groups.values()) >= MIN_MEMBERS
    assert sorted(p for m in groups.values() for p in m) == sorted(peers)
    for key, group in groups.items():
        prefix = _prefix(key)
        assert len(prefix) <= bits
        assert all(peer_bits(RUN, p).startswith(prefix) for p in group)


@settings(max_examples=200, deadline=None)
@given(members=views, bits=st.integers(0, 6))
def test_a_group_is_merged_only_where_a_child_of_it_was_under_the_minimum(
    members: frozenset[int], bits: int
) -> None:
    """Nothing merges needlessly: a group shallower than the split has a child prefix that
    holds 1 to MIN_MEMBERS - 1 peers; where no prefix at the split is that small, the groups
    are the plain prefixes (as before session 24)."""
    peers = [peer_id(i) for i in members]
    positions = [peer_bits(RUN, p) for p in peers]
    grouping = GroupingPolicy(RUN).at_bits(MembershipView.of(0, peers), bits)
    for key in grouping.members:
        prefix = _prefix(key)
        if len(prefix) < bits:
            under = [sum(p.startswith(prefix + c) for p in positions) for c in "01"]
            assert any(0 < n < MIN_MEMBERS for n in under)
    plain: dict[str, int] = {}
    for position in positions:
        plain[position[:bits]] = plain.get(position[:bits], 0) + 1
    if all(n >= MIN_MEMBERS for n in plain.values()):
        assert sorted(_prefix(k) for k in grouping.members) == sorted(plain)


@settings(max_examples=100, deadline=None)
@given(
    members=views,
    size=st.sampled_from([1, 3, 4]),
    seed=st.integers(0, 1000),
    round_=st.integers(0, 40),
)
def test_replicas_holding_one_view_decide_one_grouping_in_any_order(
    members: frozenset[int], size: int, seed: int, round_: int
) -> None:
    """Two replicas given one census (and one set of announced splits) in different orders
    decide one grouping, its merged groups included."""
    config = GroupingConfig(min_group_size=size, max_bits=6)
    peers = [peer_id(i) for i in members]
    rng = random.Random(seed)
    announced = {p: rng.randint(0, 6) for p in rng.sample(peers, min(len(peers), 5))}
    shuffled = list(peers)
    rng.shuffle(shuffled)
    a = EpochGrouping(RUN, 10, config).decide(round_, peers, announced)
    b = EpochGrouping(RUN, 10, config).decide(
        round_, shuffled, dict(reversed(list(announced.items())))
    )
    assert a == b
    if a is not None and a.num_learners > 1:
        assert min(len(m) for m in a.members.values()) >= MIN_MEMBERS


@given(st.lists(st.text("01", min_size=4, max_size=4), max_size=40), st.randoms())
def test_the_cut_does_not_depend_on_the_order_of_positions(
    positions: list[str], rng: random.Random
) -> None:
    shuffled = list(positions)
    rng.shuffle(shuffled)
    cut = merged_prefixes(positions, MIN_MEMBERS)
    assert cut == merged_prefixes(shuffled, MIN_MEMBERS)
    assert sorted(p for p in cut if any(q != p and q.startswith(p) for q in cut)) == []


def test_a_pair_at_the_split_joins_its_sibling_and_the_learner_count_follows() -> None:
    """Two peers alone under one prefix (what --group-size 2 formed on purpose) are one
    group with their sibling's peers: one learner fewer, nobody left in a group of two."""
    policy = GroupingPolicy(RUN)
    peers = [peer_id(i) for i in range(200)]
    by_half: dict[str, list[str]] = {}
    for p in peers:
        by_half.setdefault(policy.prefix_of(p, 2), []).append(p)
    view = [*by_half["00"][:2], *by_half["01"][:4], *by_half["10"][:3], *by_half["11"][:5]]
    grouping = policy.at_bits(MembershipView.of(0, view), 2)
    assert sorted(_prefix(k) for k in grouping.members) == ["0", "10", "11"]
    assert len(grouping.members["groups.0b0"]) == 6 and grouping.num_learners == 3


def test_the_group_of_two_that_this_closes_ties_its_members() -> None:
    """Why the minimum is three: the honest member's round and the other's own variant
    include one member each and void each other (`prevailing` None); at three with all
    live, the two honest members' round includes two and prevails."""
    assert prevailing(variant_of(["honest"]), variant_of(["liar"])) is None
    two, one = variant_of(["honest-a", "honest-b"]), variant_of(["liar"])
    assert prevailing(two, one) == two and prevailing(one, two) == two


def variant_of(included: list[str]) -> GroupVariant:
    """A variant as `prevailing` reads it (its included set; signatures are checked before,
    by GroupProof: tests/unit/test_group_supersede.py)."""
    return GroupVariant(0, tuple(included), (), tuple(f"d{i}" for i in included), ())


@settings(max_examples=100, deadline=None)
@given(
    members=st.frozensets(st.integers(0, 3000), min_size=6, max_size=60),
    size=st.sampled_from([3, 4]),
    missed=st.floats(0.05, 0.5),
    seed=st.integers(0, 1000),
)
def test_a_census_that_missed_peers_takes_the_full_censuss_groups_once_it_reads_them(
    members: frozenset[int], size: int, missed: float, seed: int
) -> None:
    """A replica whose epoch started from a census missing some peers (a group merged for
    want of them, or a small group missed whole, so its sibling was not merged) holds the
    full census's groups from the round it reads them, within the epoch; a later census
    that misses peers again moves nothing until the next epoch."""
    config = GroupingConfig(min_group_size=size, max_bits=4)
    peers = sorted(peer_id(i) for i in members)
    rng = random.Random(seed)
    me = rng.choice(peers)
    partial = [p for p in peers if p == me or rng.random() >= missed]
    full = EpochGrouping(RUN, 10, config, me="observer")
    whole = full.decide(0, peers)
    assert whole is not None
    announced = dict.fromkeys(peers, whole.bits)  # every peer holds the full census's split
    late = EpochGrouping(RUN, 10, config, me=me)
    first = late.decide(0, partial, announced)
    after = late.decide(1, peers, announced)
    assert after is not None and after.bits == whole.bits  # (first: None while it waits)
    # every group this replica holds is the full census's; a group it missed whole without
    # a merge on either side stays out until the next epoch (EpochGrouping._recut: the
    # learner count a member signs stays the epoch's), any merge moved takes the full groups
    assert all(group == whole.members[key] for key, group in after.members.items())
    if first is None or merged(first) or merged(whole):
        assert set(after.members) == set(whole.members)
    again = late.decide(2, partial, announced)  # a flap within the epoch
    assert again is not None and again.members == after.members
