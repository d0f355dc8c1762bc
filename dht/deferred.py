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

Fair eviction: a sender with a track record in this replica (`known`: its updates were
applied here; a peer restarting) is held ahead of fresh keys. Fresh senders share at most
`fresh_capacity` places and only ever evict each other; a known sender's push is evicted
only by another known sender when every place holds one. 64 fresh keys pushing at once
(bench.attack) used to evict every known peer's push.

Pure: no clock, no network; dht.gossip_headers calls it on the loop.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from merge.envelope import SignedHeader

DEFAULT_CAPACITY = 64
DEFAULT_READS = 2
DEFAULT_FRESH_CAPACITY = 16


@dataclass
class _Held:
    header: SignedHeader
    arrived: float
    known: bool
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

    def __init__(
        self,
        capacity: int = DEFAULT_CAPACITY,
        reads: int = DEFAULT_READS,
        fresh_capacity: int | None = None,
    ) -> None:
        """`fresh_capacity`: places fresh senders may take (min(capacity, 16) when None)."""
        if fresh_capacity is None:
            fresh_capacity = min(capacity, DEFAULT_FRESH_CAPACITY)
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"capacity must be an integer >= 0, got {capacity!r}.")
        if type(reads) is not int or reads < 1:
            raise ValueError(f"reads must be an integer >= 1, got {reads!r}.")
        if type(fresh_capacity) is not int or not 0 <= fresh_capacity <= capacity:
            raise ValueError(f"fresh_capacity must be in [0, capacity], got {fresh_capacity!r}.")
        self.capacity = capacity
        self.reads = reads
        self.fresh_capacity = fresh_capacity
        self._held: OrderedDict[str, _Held] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def hold(
        self, sender: str, header: SignedHeader, now: float, *, known: bool = False
    ) -> list[str]:
        """Hold `sender`'s pushed `header` (replacing an earlier one of the sender's, which its
        announcement still covers); the senders evicted to make room, or `sender` itself when
        there is none for it, each a rejection. `known`: the sender has a track record here."""
        self._held.pop(sender, None)
        evicted: list[str] = []
        if not known:
            if self.fresh_capacity == 0:
                return [sender]
            while self.num_fresh >= self.fresh_capacity:
                self._evict(False, evicted)
        while len(self._held) >= self.capacity:
            if not self._evict(False, evicted) and not (known and self._evict(True, evicted)):
                return evicted + [sender]  # full of known senders' pushes: they stay
        self._held[sender] = _Held(header, now, known)
        return evicted

    @property
    def num_fresh(self) -> int:
        """Held pushes of senders without a track record."""
        return sum(not held.known for held in self._held.values())

    def _evict(self, known: bool, evicted: list[str]) -> bool:
        """Evicts the oldest held push of the class `known`; False when there is none."""
        for sender, held in self._held.items():
            if held.known == known:
                del self._held[sender]
                evicted.append(sender)
                return True
        return False

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
