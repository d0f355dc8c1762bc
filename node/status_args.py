"""`status`'s page flags: parsed before anything imports hivemind."""

from __future__ import annotations

import argparse

from dht.pages import MAX_PAGE_SIZE

DEFAULT_PAGE_SIZE = 50
"""Peers one `status` page shows; the totals above it cover the whole swarm."""
PageRequest = tuple[int, int]
"""(page number from 1, peers per page)."""


def page_size(text: str) -> int:
    """--page-size's type: 1 to MAX_PAGE_SIZE."""
    try:
        size = int(text)
    except ValueError:
        size = 0
    if not 1 <= size <= MAX_PAGE_SIZE:
        raise argparse.ArgumentTypeError(f"a page holds 1 to {MAX_PAGE_SIZE} peers, got {text!r}")
    return size
