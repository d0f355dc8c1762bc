"""Learner groups: every replica reaches the same grouping, and churn moves no bystander."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import Grouping, GroupingConfig, GroupingPolicy, MembershipView

POLICY = GroupingPolicy("run-a")
PEERS = [f"12D3KooWpeer{i:04d}" for i in range(2000)]
peer_sets = st.sets(st.sampled_from(PEERS), max_size=150)


@settings(max_examples=50, deadline=None)
@given(peer_sets, st.integers(0, 5), st.randoms(use_true_random=False))
def test_replicas_that_see_one_view_in_any_order_decide_one_grouping(
    peers: set[str], previous_bits: int, rng: random.Random
) -> None:
    shuffled = list(peers)
    rng.shuffle(shuffled)
    a = POLICY.decide(MembershipView.of(3, peers), previous_bits)
    b = GroupingPolicy("run-a").decide(MembershipView.of(3, shuffled), previous_bits)
    assert a == b
    assert sorted(p for group in a.members.values() for p in group) == sorted(peers)
    # a peer's group is its prefix at the split, or an ancestor of it (a group under
    # MIN_MEMBERS merged into its parent: dht.grouping.merged_prefixes)
    assert all(POLICY.key_of(p, a.bits).startswith(str(a.group_of(p))) for p in peers)


@settings(max_examples=50, deadline=None)
@given(
    peer_sets,
    st.sets(st.sampled_from(PEERS), max_size=5),
    st.sets(st.sampled_from(PEERS), max_size=5),
)
def test_joins_and_leaves_at_the_same_bits_move_no_other_peer(
    peers: set[str], joins: set[str], leaves: set[str]
) -> None:
    before = POLICY.decide(MembershipView.of(1, peers))
    after_peers = (peers | joins) - leaves
    after = POLICY.decide(MembershipView.of(2, after_peers), before.bits)
    stayed = peers & after_peers
    # a peer moves only to a descendant or an ancestor of its group: at one split, only
    # where a group crossed MIN_MEMBERS (merged into its parent, or out of it again)
    for p in stayed:
        old, new = str(before.group_of(p)), str(after.group_of(p))
        assert old.startswith(new) or new.startswith(old)
    deepest = _no_merge(before) and _no_merge(after)
    if after.bits == before.bits and deepest:
        assert all(before.group_of(p) == after.group_of(p) for p in stayed)


def _no_merge(grouping: Grouping) -> bool:
    """Every group of `grouping` is at its split's depth (none was under MIN_MEMBERS)."""
    return all(len(key) - len("groups.0b") == grouping.bits for key in grouping.members)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.integers(-3, 3))
def test_churn_within_the_margin_never_changes_the_number_of_groups(n: int, churn: int) -> None:
    bits = POLICY.bits_for(n)
    config = POLICY.config
    lower = POLICY.peers_at(bits) * (1 - config.hysteresis)
    upper = POLICY.peers_at(bits + 1) * (1 + config.hysteresis)
    if lower <= n + churn < upper:
        assert POLICY.bits_for(n + churn, bits) == bits


@pytest.mark.parametrize(
    ("n", "learners"),
    [(1, 1), (8, 1), (15, 1), (16, 2), (64, 8), (256, 16), (511, 16), (512, 32), (1000, 32)],
)
def test_the_swarm_has_a_dozen_to_a_few_dozen_learners_not_n(n: int, learners: int) -> None:
    grouping = POLICY.decide(MembershipView.of(0, PEERS[:n]))
    assert grouping.num_learners == learners
    assert min(len(m) for m in grouping.members.values()) >= 1


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 20000),
    st.sampled_from([3, 4, 8, 16]),
    st.integers(0, 8),
    st.integers(0, 8),
)
def test_a_group_holds_at_least_half_as_many_peers_as_there_are_groups(
    n: int, size: int, max_bits: int, previous: int
) -> None:
    """On average, from any previous split (a shrinking swarm keeps a split down to the
    hysteresis margin): a member's slices of the other groups' updates stay about one
    update's bytes (GroupingPolicy.group_floor)."""
    policy = GroupingPolicy("run-a", GroupingConfig(min_group_size=size, max_bits=max_bits))
    for bits in (policy.bits_for(n), policy.bits_for(n, previous)):
        assert 0 <= bits <= max_bits
        assert bits == 0 or n / 2**bits >= 2**bits / 2 * (1 - policy.config.hysteresis)
    target = policy.bits_for(n)
    assert target == 0 or n / 2**target >= max(size, 2**target / 2)


def test_a_thousand_peers_form_groups_of_about_n_over_32() -> None:
    sizes = [len(m) for m in POLICY.decide(MembershipView.of(0, PEERS[:1000])).members.values()]
    assert sum(sizes) == 1000
    assert min(sizes) >= 15 and max(sizes) <= 50  # binomial around 31


def test_another_run_groups_the_same_peers_differently() -> None:
    a = POLICY.decide(MembershipView.of(0, PEERS[:64]))
    b = GroupingPolicy("run-b").decide(MembershipView.of(0, PEERS[:64]))
    assert a.members != b.members


@pytest.mark.parametrize(
    "kwargs", [{"min_group_size": 0}, {"max_bits": 17}, {"hysteresis": 1.0}, {"max_bits": 1.5}]
)
def test_bad_settings_are_refused_with_one_sentence(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="must be"):
        GroupingConfig(**kwargs)  # type: ignore[arg-type]
