"""bench.scale --balanced: identities that give every learner group its share of the nodes."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.scale_keys import balanced_identities, group_quotas
from dht.grouping import GroupingConfig, GroupingPolicy

RUN = "bench-scale"


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(1, 40), group_size=st.integers(1, 8))
def test_the_grouping_policy_puts_balanced_identities_in_groups_a_node_apart(
    nodes: int, group_size: int
) -> None:
    identities = balanced_identities(RUN, nodes, group_size)
    policy = GroupingPolicy(RUN, GroupingConfig(min_group_size=group_size))
    bits = policy.bits_for(nodes)
    sizes = Counter(policy.key_of(i.peer_id, bits) for i in identities)
    assert len({i.peer_id for i in identities}) == nodes
    assert len(sizes) == min(2**bits, nodes)
    assert max(sizes.values()) - min(sizes.values()) <= 1


def test_sixteen_nodes_in_groups_of_four_are_four_groups_of_four_interleaved() -> None:
    identities = balanced_identities(RUN, 16, 4)
    policy = GroupingPolicy(RUN, GroupingConfig(min_group_size=4))
    keys = [policy.key_of(i.peer_id, 2) for i in identities]
    assert sorted(Counter(keys).values()) == [4, 4, 4, 4]
    assert len(set(keys[:4])) == 4  # the first four to start, one per group


def test_quotas_follow_the_policy_split_and_spread_the_remainder() -> None:
    assert group_quotas(RUN, 8, 4) == {"0": 4, "1": 4}
    assert group_quotas(RUN, 7, 4) == {"": 7}  # 7 < 2 x 4: one group
    assert group_quotas(RUN, 18, 4) == {"00": 5, "01": 5, "10": 4, "11": 4}


@pytest.mark.parametrize(("nodes", "group_size"), [(0, 4), (4, 0)])
def test_no_nodes_or_no_group_size_is_a_clear_error(nodes: int, group_size: int) -> None:
    with pytest.raises(ValueError, match="need nodes >= 1 and group size >= 1"):
        group_quotas(RUN, nodes, group_size)
