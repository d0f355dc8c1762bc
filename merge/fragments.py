"""Fragments of the model (Streaming DiLoCo, arXiv 2501.18512): tensors bin-packed into P parts.

Each fragment is a set of whole tensors; the packing is balanced greedily (largest tensor
first, into the lightest fragment), which keeps the largest fragment within 4/3 of the best
possible packing and within one tensor of the mean. Fragment p is published at inner step
p * H / P of each round, so a node's upload is spread over the round instead of sent at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def partition(sizes: Sequence[int], num_fragments: int) -> list[list[int]]:
    """Tensor indices per fragment, each list ascending; fragments ordered by first tensor."""
    if type(num_fragments) is not int or not 1 <= num_fragments <= max(1, len(sizes)):
        raise ValueError(
            f"fragments must be an integer in [1, {max(1, len(sizes))}] (one per tensor at "
            f"most), got {num_fragments!r}."
        )
    if any(type(size) is not int or size < 0 for size in sizes):
        raise ValueError("tensor sizes must be non-negative integers.")
    heap = [(0, p) for p in range(num_fragments)]
    members: list[list[int]] = [[] for _ in range(num_fragments)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, p = heapq.heappop(heap)
        members[p].append(index)
        heapq.heappush(heap, (load + sizes[index], p))
    fragments = [sorted(m) for m in members if m]
    return sorted(fragments, key=lambda m: m[0])


def publish_steps(num_fragments: int, inner_steps: int) -> list[int]:
    """The inner step (1..H) after which each fragment is published: evenly staggered."""
    if not 1 <= num_fragments <= inner_steps:
        raise ValueError(f"fragments must be in [1, H = {inner_steps}], got {num_fragments}.")
    return [(p + 1) * inner_steps // num_fragments for p in range(num_fragments)]
