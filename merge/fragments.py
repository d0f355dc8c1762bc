"""Fragments of the model (Streaming DiLoCo, arXiv 2501.18512): tensors bin-packed into P parts.

Each fragment is a set of whole tensors; the packing is balanced greedily (largest tensor
first, into the lightest fragment), which keeps the largest fragment within 4/3 of the best
possible packing and within one tensor of the mean. Fragment p (from 0) is published after
inner step (p + 1) * H / P of each round, so a node's upload is spread over the round instead
of sent at once, and a node that dies mid-round has already published the fragments before.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch


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


class FragmentLayout:
    """Where each fragment's tensors lie in the flat parameter vector (the replica's order).

    Built from the model's tensor sizes in ``parameters()`` order, so every node of a run that
    agrees on the model and P splits it identically. A fragment's vector (its pseudo-gradient,
    its outer optimizer state) is its tensors concatenated in ascending order.
    """

    def __init__(self, sizes: Sequence[int], num_fragments: int) -> None:
        self.sizes = tuple(sizes)
        self.tensors = tuple(tuple(part) for part in partition(self.sizes, num_fragments))
        offsets = [0]
        for size in self.sizes:
            offsets.append(offsets[-1] + size)
        self.numel = offsets[-1]
        self.ranges = tuple(
            tuple((offsets[i], offsets[i + 1]) for i in part) for part in self.tensors
        )
        """Per fragment, the (start, end) of each of its tensors in the flat vector."""

    @property
    def num_fragments(self) -> int:
        """P; fewer than asked only for a model with fewer tensors (partition refuses that)."""
        return len(self.tensors)

    def fragment_numel(self, fragment: int) -> int:
        return sum(end - start for start, end in self.ranges[fragment])

    def gather(self, flat: torch.Tensor, fragment: int) -> torch.Tensor:
        """A copy of ``fragment``'s elements of ``flat``, its tensors concatenated."""
        self._check(flat)
        return torch.cat([flat[start:end] for start, end in self.ranges[fragment]])

    def scatter(self, flat: torch.Tensor, fragment: int, values: torch.Tensor) -> None:
        """Writes ``values`` (a fragment vector) into ``fragment``'s elements of ``flat``."""
        self._check(flat)
        if values.shape != (self.fragment_numel(fragment),):
            raise ValueError(f"fragment {fragment} has {self.fragment_numel(fragment)} elements.")
        offset = 0
        for start, end in self.ranges[fragment]:
            flat[start:end].copy_(values[offset : offset + end - start])
            offset += end - start

    def locate(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For flat positions ``index`` (int64): their fragments and their positions in those
        fragments' vectors."""
        starts, fragments, local_starts = [], [], []
        for number, ranges in enumerate(self.ranges):
            local = 0
            for start, end in ranges:
                starts.append(start)
                fragments.append(number)
                local_starts.append(local)
                local += end - start
        order = sorted(range(len(starts)), key=starts.__getitem__)
        flat_starts = torch.tensor([starts[i] for i in order], dtype=torch.int64)
        tensor = torch.searchsorted(flat_starts, index, right=True) - 1
        fragment = torch.tensor([fragments[i] for i in order], dtype=torch.int64)[tensor]
        local_start = torch.tensor([local_starts[i] for i in order], dtype=torch.int64)[tensor]
        return fragment, local_start + index - flat_starts[tensor]

    def _check(self, flat: torch.Tensor) -> None:
        if flat.shape != (self.numel,):
            raise ValueError(f"a flat vector of this layout has {self.numel} elements.")
