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
from collections.abc import Mapping
from typing import Any, TypeVar

import torch

from merge.codec_base import Codec
from merge.feedback import Compressor
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

    def state_dict(self) -> dict[str, object]:
        """What a restart must not forget (loadable with torch.load(weights_only=True)): the
        carried rounds (id, digest, tensor), the included ones (id, digest), what is owed."""
        with self._lock:
            return {
                "carried": [[*rid, d, t.clone()] for rid, (d, t) in self._carried.items()],
                "included": [[*rid, d] for rid, d in self._included.items()],
                "owed": None if self._owed is None else self._owed.clone(),
                "num_owed": self.num_owed,
            }

    def load_state_dict(self, state: Mapping[str, object], numel: int) -> None:
        """Restores a `state_dict` of a replica of `numel` parameters; ValueError (nothing
        changed) for one that is not (a checkpoint of another model, or damaged)."""
        carried: OrderedDict[RoundId, tuple[str, torch.Tensor]] = OrderedDict()
        included: OrderedDict[RoundId, str] = OrderedDict()
        for row in _rows(state.get("carried"), 5):
            carried[_rid(row)] = (_text(row[3]), _vector(row[4], numel))
        for row in _rows(state.get("included"), 4):
            included[_rid(row)] = _text(row[3])
        owed = state.get("owed")
        owed = None if owed is None else _vector(owed, numel)
        num_owed = state.get("num_owed", 0)
        if type(num_owed) is not int or num_owed < 0:
            raise ValueError("carried contributions: num_owed is not a count")
        _bound(carried, self.max_rounds)
        _bound(included, self.max_rounds)
        with self._lock:
            self._carried, self._included, self._owed = carried, included, owed
            self.num_owed = num_owed

    def _owe(self, total: torch.Tensor) -> None:
        self.num_owed += 1
        self._owed = total.detach().clone() if self._owed is None else self._owed.add_(total)


def _bound(table: OrderedDict[RoundId, V], size: int) -> None:
    while len(table) > size:
        table.popitem(last=False)


def _rows(value: object, width: int) -> list[list[Any]]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(
        isinstance(r, list) and len(r) == width for r in value
    ):
        raise ValueError(f"carried contributions: rows of {width} fields expected")
    return value


def _rid(row: list[Any]) -> RoundId:
    key, epoch, round_ = row[:3]
    if not isinstance(key, str) or type(epoch) is not int or type(round_) is not int:
        raise ValueError("carried contributions: a round id that is not (key, epoch, round)")
    return (key, epoch, round_)


def _text(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError("carried contributions: a digest that is not text")
    return value


def _vector(value: object, numel: int) -> torch.Tensor:
    if (
        not isinstance(value, torch.Tensor)
        or value.shape != (numel,)
        or value.dtype != torch.float32
        or not bool(torch.isfinite(value).all())
    ):
        raise ValueError(f"carried contributions: a tensor that is not {numel} finite fp32")
    return value.clone()


class GroupFeedback(Compressor):
    """A group member's error feedback: the residual (what no group applied yet and what its
    parts' codec rounded off) and its carried contributions, checkpointed together, so a
    restart remembers which carried rounds an update may still include (session 10 forgot
    them: such an update arriving after a restart was counted twice)."""

    def __init__(self, codec: Codec, numel: int, carried: CarriedContributions) -> None:
        super().__init__(codec, numel)
        self.carried = carried

    def state_dict(self) -> dict[str, object]:
        return {**super().state_dict(), "group_carried": self.carried.state_dict()}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restores both; a checkpoint without carries (groups off, or session 10's) has
        none to restore."""
        carried = state.get("group_carried")
        if carried is not None:
            if not isinstance(carried, Mapping):
                raise ValueError("carried contributions: not a mapping")
            self.carried.load_state_dict(carried, self.numel)
        super().load_state_dict(state)
