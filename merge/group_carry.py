"""A member's carried contributions: never counted twice when a round it gave up on completes.

A learner-group member that is not in its round's update (its round was abandoned, or it
gave up at its co-signature deadline, or the update left it out) keeps its contribution in
its error-feedback residual and adds it to its next round's (node.group_publishing). But a
round this member gave up on may still have completed at the others (they had its
co-signature), and the complete update then reaches this member later, pushed or fetched:
every replica applies it with this member's contribution in it, and the next round's
contribution carries the same progress again. Counted twice.

Decided from signed facts, so every replica and the member agree on it: the complete
update's included members are signed (every member's `ContributionHeader`, co-signed over
the included set), and this member's header in it names the digest of exactly the tensor it
carried. When an applied group update includes this member's contribution to a round with
the digest of what it carried for that round, that tensor is owed: taken back out of the
residual (or, if the next round's contribution already carried it, out of the round after:
the sum of everything this member's included contributions hold stays the sum of what it
trained). Either order is handled: the update may come before the member settles the round
(a push while it still waits for co-signatures) or after. Pure and thread-safe (the update
is applied on the merge's thread; the member settles on the trainer's).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TypeVar

import torch

from merge.group_update import ContributionHeader, GroupUpdate

V = TypeVar("V")
RoundId = tuple[str, int, int]
"""(group key, epoch, round)."""
MAX_ROUNDS = 8
"""Rounds whose carried tensor (a whole pseudo-gradient each) or inclusion is remembered: a
round's update that comes later than that is counted twice (the rounds of a few minutes of
training; memory stays MAX_ROUNDS model-sized tensors at most)."""


def round_id(header: ContributionHeader) -> RoundId:
    return (header.group_key, header.epoch, header.round)


class CarriedContributions:
    """This member's contributions that no update included when it settled their rounds,
    and what it owes for those that an applied update turned out to include."""

    def __init__(self, me: str, max_rounds: int = MAX_ROUNDS) -> None:
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds!r}.")
        self.me, self.max_rounds = me, max_rounds
        self._lock = threading.Lock()
        self._carried: OrderedDict[RoundId, tuple[str, torch.Tensor]] = OrderedDict()
        """Rounds settled without this member: the digest it signed and the tensor carried."""
        self._included: OrderedDict[RoundId, str] = OrderedDict()
        """Rounds whose applied update included this member (the digest in it), not carried."""
        self._owed: torch.Tensor | None = None
        self.num_owed = 0
        """Carried contributions found included later (each taken back once)."""

    def carry(self, header: ContributionHeader, total: torch.Tensor) -> None:
        """This member settled `header`'s round without an update that includes it and keeps
        `total` (what the header signed) in its residual."""
        rid = round_id(header)
        with self._lock:
            if self._included.get(rid) == header.digest:  # its update was applied already
                del self._included[rid]
                self._owe(total)
                return
            self._carried[rid] = (header.digest, total.detach().clone())
            _bound(self._carried, self.max_rounds)

    def applied(self, update: GroupUpdate) -> bool:
        """A group update this replica applied; True when it included a contribution this
        member carried (now owed)."""
        mine = next((h for h in update.contributions if h.author == self.me), None)
        if mine is None:
            return False
        rid = round_id(mine)
        with self._lock:
            carried = self._carried.get(rid)
            if carried is not None and carried[0] == mine.digest:
                del self._carried[rid]
                self._owe(carried[1])
                return True
            self._included[rid] = mine.digest
            _bound(self._included, self.max_rounds)
            return False

    def take_owed(self) -> torch.Tensor | None:
        """What to take out of the residual (or the next contribution) now, once."""
        with self._lock:
            owed, self._owed = self._owed, None
            return owed

    def _owe(self, total: torch.Tensor) -> None:
        self.num_owed += 1
        self._owed = total.detach().clone() if self._owed is None else self._owed.add_(total)


def _bound(table: OrderedDict[RoundId, V], size: int) -> None:
    while len(table) > size:
        table.popitem(last=False)
