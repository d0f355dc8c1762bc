"""Pages of a sorted list of peers: which slice one page is (pure, imports nothing heavy,
so `status`'s flags parse without hivemind)."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_PAGE_SIZE = 1000
"""Most peers one page holds."""


@dataclass(frozen=True)
class Page:
    """Which slice of a sorted list of `total` items one page is: items[start:stop]."""

    number: int
    """From 1; the last page when the one asked for lies beyond it."""
    size: int
    pages: int
    """At least 1 (one empty page when there are no items)."""
    total: int

    @property
    def start(self) -> int:
        return (self.number - 1) * self.size

    @property
    def stop(self) -> int:
        return min(self.total, self.number * self.size)


def page_bounds(total: int, number: int, size: int) -> Page:
    """Page `number` of `size` items out of `total`: numbers below 1 give the first page,
    numbers past the end the last one (a list that shrank between two clicks stays readable)."""
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}.")
    if not 1 <= size <= MAX_PAGE_SIZE:
        raise ValueError(f"a page holds 1 to {MAX_PAGE_SIZE} peers, got {size}.")
    pages = max(1, math.ceil(total / size))
    return Page(min(max(number, 1), pages), size, pages, total)
