"""Pushed headers from peers whose heartbeat this node has not read yet, held for a read or two.

Only peers with a live signed heartbeat may push (fresh keys get no state: Sybil floods), but
a node that just joined or restarted pushes its first headers before its peers' next read of
the peers record: those pushes were counted as `notify_unknown_peer` against honest peers
(bench.scale, N = 8: 107 in a run without an attacker), and the dashboard showed colleagues as
offenders. A header from an unknown sender or author is now held, one per sender and at most
`capacity` in all, until `reads` membership reads that started after it arrived have returned:
applied as pushed once both peers are live, counted as a rejection if they are still unknown
then. Holding is bounded whatever the number of keys (a flood evicts the oldest, which are
counted), and nothing about an author is marked before its heartbeat is read.

Pure: no clock, no network; dht.gossip calls it on the loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from merge.envelope import SignedHeader

DEFAULT_CAPACITY = 64
DEFAULT_READS = 2


@dataclass
class _Held:
    header: SignedHeader
    arrived: float
    reads: int = 0


@dataclass(frozen=True)
class Settled:
    """What the held headers came to after a read."""

    accepted: list[SignedHeader]
    """Headers whose sender and author are now live: handled as if pushed now."""
    refused: list[str]
    """Senders still unknown after `reads` reads, or evicted: one rejection each."""


class DeferredNotifies:
    """Pushed headers waiting for their sender's and author's heartbeats."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, reads: int = DEFAULT_READS) -> None:
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"capacity must be an integer >= 0, got {capacity!r}.")
        if type(reads) is not int or reads < 1:
            raise ValueError(f"reads must be an integer >= 1, got {reads!r}.")
        self.capacity = capacity
        self.reads = reads
        self._held: OrderedDict[str, _Held] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, sender: str, header: SignedHeader, now: float) -> list[str]:
        """Hold `sender`'s pushed `header` (replacing an earlier one of the sender's, which its
        announcement still covers); the senders evicted to make room, each a rejection."""
        self._held.pop(sender, None)
        evicted = []
        while self._held and len(self._held) >= self.capacity:
            evicted.append(self._held.popitem(last=False)[0])
        if self.capacity == 0:
            return [sender]
        self._held[sender] = _Held(header, now)
        return evicted

    def after_read(self, read_started: float, is_alive: Callable[[str], bool]) -> Settled:
        """A membership read that started at `read_started` returned: headers that arrived
        before it whose sender and author are live are accepted; those still unknown after
        `reads` such reads are refused."""
        accepted: list[SignedHeader] = []
        refused: list[str] = []
        for sender, held in list(self._held.items()):
            if held.arrived > read_started:
                continue  # the read may have begun before the sender's heartbeat was stored
            if is_alive(sender) and is_alive(held.header.header.author):
                accepted.append(held.header)
                del self._held[sender]
                continue
            held.reads += 1
            if held.reads >= self.reads:
                refused.append(sender)
                del self._held[sender]
        return Settled(accepted, refused)
