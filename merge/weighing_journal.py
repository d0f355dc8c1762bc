"""Taking one applied update's traces back out of the state that weighs later updates.

A learner group's lesser variant, superseded by a proof after it was applied here
(merge.group_equivocation `prevailing`, docs/scale.md session 23), left records in the robust
window (its norm), the learner floor (its claim), the contribution ledger (its co-signers'
charge and record) and the replica's progress (its credited share). Those windows decide how
later updates are sized, so near a threshold a replica that applied the lesser variant first
would size the prevailing one, and what follows, unlike a replica that never applied it.

None of those records can be subtracted exactly: windows evict, medians and the ledger's
decays are not linear. So every mutation of them is journaled, tagged with the id of the
update it was made for (`tag`, set by `Replica.apply`), from a shadow copy of each structure
taken when the journal (re)started; `take_back(uid)` restores the shadows and replays every
journaled mutation but `uid`'s, with the arguments they had (what was decided then). A
replica that applied the lesser variant and nothing since then holds exactly the state it
held before it (bit for bit); one that applied others in between holds what it would hold
had the others recorded what they recorded and the lesser nothing (the others' decisions,
taken with the lesser's records in place, are not re-made: that is any arrival order's
difference, DESIGN.md).

Bounded: at most `MAX_OPS` mutations are kept, in two generations from two shadow copies;
an id whose mutations went with an older generation, or a structure loaded from a checkpoint
or a donor since (`reset`), can no longer be taken back (`take_back` answers False, and the
caller keeps the records, as before this journal). Journaled only where learner groups are
on (`UpdatePipeline.enable_groups`): nothing else is taken back. Not thread-safe: the
pipeline calls it under the replica lock.
"""

from __future__ import annotations

import copy
from collections import deque
from collections.abc import Hashable
from typing import Any

_Op = tuple[Hashable, int, str, tuple[tuple[Any, ...], dict[str, Any]]]
"""(tag, target index, mutator, (args, kwargs))."""
MAX_OPS = 512
"""Mutations the journal keeps at most; at least half of it (each update makes up to four,
so the last 64 updates at least)."""


class Journaled:
    """A structure whose mutations a `WeighingJournal` records. A subclass calls `_journal`
    at the start of each public mutator with the mutator's name and arguments; the mutator
    must depend on nothing but the structure's own state and those arguments."""

    journal: WeighingJournal | None = None

    def _journal(self, method: str, *args: Any, **kwargs: Any) -> None:
        if self.journal is not None:
            self.journal.log(self, method, args, kwargs)

    def _journal_reset(self) -> None:
        """The structure was loaded wholesale: nothing before can be replayed."""
        if self.journal is not None:
            self.journal.reset()

    def __deepcopy__(self, memo: dict[int, Any]) -> Journaled:
        """A copy outside the journal (the sharded round's decider copies these)."""
        fresh = self.__class__.__new__(self.__class__)
        memo[id(self)] = fresh
        for key, value in self.__dict__.items():
            if key != "journal":
                fresh.__dict__[key] = copy.deepcopy(value, memo)
        return fresh


class CreditedSum(Journaled):
    """The replica's applied updates counted by their credited shares (merge.replica)."""

    def __init__(self, total: float = 0.0) -> None:
        self.total = total

    def add(self, share: float) -> None:
        self._journal("add", share)
        self.total += share


class WeighingJournal:
    """The mutations of the attached structures since shadow copies of them, each tagged.

    Two generations: a shadow copy of every structure is taken each `max_ops` / 2 mutations
    and the oldest generation dropped, so the mutations of the last `max_ops` / 2 at least
    can be taken back, at the cost of one copy of the structures per `max_ops` / 2."""

    def __init__(self, max_ops: int = MAX_OPS) -> None:
        self.tag: Hashable = None
        """The id the next mutations are made for (None: none, never taken back)."""
        self.max_ops = max_ops
        self._targets: list[Journaled] = []
        self._generations: deque[tuple[list[Journaled], list[_Op]]] = deque()
        self._replaying = False

    def __len__(self) -> int:
        return sum(len(ops) for _, ops in self._generations)

    def attach(self, *targets: Journaled) -> None:
        """Journals `targets` (replacing any attached before), from their state now."""
        for target in self._targets:
            target.journal = None
        self._targets = list(targets)
        for target in self._targets:
            target.journal = self
        self.reset()

    def reset(self) -> None:
        """Starts again from the structures' state now: nothing before is taken back."""
        self._generations.clear()
        self._generations.append(([copy.deepcopy(t) for t in self._targets], []))

    def log(
        self, target: Journaled, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Called by a structure before it mutates itself (its arguments are not mutated
        after: values, tuples and frozen records only)."""
        if self._replaying:
            return
        index = next((i for i, t in enumerate(self._targets) if t is target), None)
        if index is None:  # a structure the pipeline no longer holds
            target.journal = None
            return
        ops = self._generations[-1][1]
        if len(ops) >= max(1, self.max_ops // 2):
            ops = []
            self._generations.append(([copy.deepcopy(t) for t in self._targets], ops))
            while len(self._generations) > 2:
                self._generations.popleft()
        ops.append((self.tag, index, method, (args, kwargs)))

    def holds(self, tag: Hashable) -> bool:
        """Whether mutations made for `tag` are journaled (and can be taken back)."""
        return tag is not None and any(op[0] == tag for _, ops in self._generations for op in ops)

    def take_back(self, tag: Hashable) -> bool:
        """Every structure as if the mutations made for `tag` had never been: the shadows of
        the generation its first mutation is in restored, the other mutations since replayed
        in order. False (and nothing changed) where none of them is journaled."""
        if any(t.journal is not self for t in self._targets):
            self.attach(*self._targets)  # another journal took one over: start again
            return False
        first = next(
            (i for i, (_, ops) in enumerate(self._generations) if any(op[0] == tag for op in ops)),
            None,
        )
        if tag is None or first is None:
            return False
        shadows = self._generations[first][0]
        kept = [op for _, ops in list(self._generations)[first:] for op in ops if op[0] != tag]
        self._replaying = True
        try:
            for target, shadow in zip(self._targets, shadows, strict=True):
                restored = copy.deepcopy(shadow)
                target.__dict__.update(
                    {k: v for k, v in restored.__dict__.items() if k != "journal"}
                )
            for _, index, name, (args, kwargs) in kept:
                getattr(self._targets[index], name)(*args, **kwargs)
        finally:
            self._replaying = False
        self._generations.clear()  # later shadows held the mutations taken back
        self._generations.append((shadows, kept))
        return True
