"""Identities that spread a bench swarm evenly over its learner groups (`bench.scale
--balanced`).

Peers form groups by the prefix of their position (dht.grouping), so N fresh random
identities draw uneven groups: session 18's 16-node runs drew 8 + 4 + 3 + 1 and 7 + 5 + 2 + 2
at `--group-size 4`, and its 8-node shard-fetch runs 7 + 1 and 4 + 4, which made rows of one
command not like for like. Balanced identities give every group N / G members (the first
N mod G groups one more), as the grouping policy would split N peers at that group size.
"""

from __future__ import annotations

from collections.abc import Callable

from dht.grouping import GroupingConfig, GroupingPolicy, peer_bits
from merge.identity import Identity

MAX_TRIES_PER_NODE = 10_000
"""Identities generated per node at most before giving up (a bucket is 1 / G of them)."""


def group_quotas(run_id: str, num_nodes: int, group_size: int) -> dict[str, int]:
    """Prefix -> how many of `num_nodes` peers a balanced swarm puts in it: the grouping's
    bits for that many peers at `group_size` (GroupingPolicy.bits_for), every prefix of
    that length, the remainder to the first ones in order."""
    if num_nodes < 1 or group_size < 1:
        raise ValueError(f"need nodes >= 1 and group size >= 1, got {num_nodes}, {group_size}.")
    policy = GroupingPolicy(run_id, GroupingConfig(min_group_size=group_size))
    bits = policy.bits_for(num_nodes)
    groups = 2**bits
    prefixes = [format(b, f"0{bits}b") if bits else "" for b in range(groups)]
    return {p: num_nodes // groups + (i < num_nodes % groups) for i, p in enumerate(prefixes)}


def balanced_identities(
    run_id: str,
    num_nodes: int,
    group_size: int,
    generate: Callable[[], Identity] = Identity.generate,
) -> list[Identity]:
    """`num_nodes` identities whose groups follow `group_quotas`, interleaved by group
    (node i in group i mod G while every group has members left), so the first nodes to
    start, the bootstrap among them, are spread over the groups too."""
    quotas = group_quotas(run_id, num_nodes, group_size)
    bits = len(next(iter(quotas)))
    buckets: dict[str, list[Identity]] = {p: [] for p in quotas}
    for _ in range(MAX_TRIES_PER_NODE * num_nodes):
        if all(len(buckets[p]) == q for p, q in quotas.items()):
            break
        identity = generate()
        prefix = peer_bits(run_id, identity.peer_id)[:bits]
        if len(buckets[prefix]) < quotas[prefix]:
            buckets[prefix].append(identity)
    else:
        raise RuntimeError(f"no balanced identities for {num_nodes} nodes in the tries allowed.")
    ordered: list[Identity] = []
    while any(buckets.values()):
        for prefix in quotas:
            if buckets[prefix]:
                ordered.append(buckets[prefix].pop(0))
    return ordered
