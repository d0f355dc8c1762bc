"""One member's side of a round of other groups' updates merged as one linear step
(merge.shard_round; docs/scale.md, Session 16): what the wiring drives from messages.

The member holds one slice of the model (its rank in the group's sorted member list, split on
the chunk grid: merge.group_chunks `aligned_bounds`). It takes its slice of each incoming
update (`fetched`; the caller has checked the bytes against the update's co-signed digests),
sends its part Gram matrix (`part`), checks every other member's (`part_from`), decides from
their sum once all are in (`decide`: every member decides alike), sends its slices of the
round's weighted sums (`sums`), checks every other member's (`sums_from`) and, once all are in,
applies the round (`apply`). Anything wrong (a part or slices that fail their checks, a slice
of the wrong size or not finite, the replica moved meanwhile) sets `failed` and nothing is
applied: the caller then fetches the round's updates whole and applies them one by one
(`GroupMerge.submit` in id order), which ends where this would have (tests/unit/
test_shard_round.py). Pure: no network, no clock; driven under no lock of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from merge.group_chunks import aligned_bounds
from merge.result import MergeResult
from merge.shard_part import wire_part
from merge.shard_round import (
    CapUndecided,
    Gram,
    Incoming,
    RoundPlan,
    ShardRound,
    part_gram,
    part_problem,
    round_problem,
    state_tensors,
    summed_gram,
    sums_problem,
)


class MemberRound:
    """One member's round: its slice, the members' parts and sums, the outcome."""

    def __init__(
        self,
        rounds: ShardRound,
        members: Sequence[str],
        me: str,
        incoming: Sequence[Incoming],
        *,
        until_fold: bool = True,
    ) -> None:
        self.rounds, self.me, self.until_fold = rounds, me, until_fold
        self.members = tuple(sorted(set(members)))
        if me not in self.members:
            raise ValueError("a member's round needs it among the members.")
        replica = rounds.merge.pipeline.replica
        numel = replica.numel
        self.base = (replica.num_applied, replica.applied_digest())
        """The applied set the round is on: its part, the others' checks and the plan."""
        self.bounds = dict(zip(self.members, aligned_bounds(numel, len(self.members)), strict=True))
        self.incoming = rounds.order(incoming)
        self.failed: str | None = None
        """Why the round falls back to the whole fetch (None: not so far)."""
        self.plan: RoundPlan | None = None
        self._shards: dict[int, torch.Tensor] = {}
        self._parts: dict[str, Gram] = {}
        self._sums: dict[str, list[torch.Tensor]] = {}

    @property
    def slice(self) -> tuple[int, int]:
        """[start, end) of the model this member holds the round's updates of."""
        return self.bounds[self.me]

    def needs(self) -> list[int]:
        """The incoming updates (indices in id order) whose slice this member still needs:
        those its headers do not refuse."""
        return [
            i
            for i, inc in enumerate(self.incoming)
            if inc.problem is None and i not in self._shards
        ]

    def fetched(self, index: int, piece: torch.Tensor) -> bool:
        """This member's slice of the `index`-th update; False (the round fails) when it is
        not one: of the wrong size or dtype, or not finite."""
        start, end = self.slice
        if not (0 <= index < len(self.incoming)) or self.failed is not None:
            return False
        if piece.dtype != torch.float32 or piece.shape != (end - start,):
            return self._fail("slice_shape")
        if not bool(torch.isfinite(piece).all()):
            return self._fail("slice_not_finite")  # fetched whole, it is refused
        self._shards[index] = piece
        return True

    def part(self) -> Gram | None:
        """This member's part Gram matrix, once it has every slice it needs (None before, or
        when the replica moved since the round's base: "replica_moved", no part of another
        state is sent), in float32 values (merge.shard_part `wire_part`, session 29): what it
        sends is what it sums, bit for bit, as every other member does."""
        if self.needs() or self.failed is not None:
            return None
        with self.rounds.merge.pipeline.replica.lock:
            if self._moved():
                return None
            part = wire_part(part_gram(self._states(self.me) + self._slices()))
        if part is None:  # beyond float32: no part can be sent, nobody's fault
            self._fail("part_out_of_range")
            return None
        self._parts[self.me] = part
        return part

    def part_from(self, member: str, part: object) -> bool:
        """Another member's part matrix (counted once); False when it fails its checks, or
        when this replica moved since the round's base (its state is not the one the part
        is checked against: "replica_moved", nobody's fault)."""
        if member not in self.bounds or member in self._parts or self.failed is not None:
            return False
        with self.rounds.merge.pipeline.replica.lock:
            if self._moved():
                return False
            problem = part_problem(part, self._states(member), len(self.incoming))
        if problem is not None:
            return self._fail(f"{problem} from {member}")
        assert isinstance(part, list)
        self._parts[member] = part
        return True

    def decide(self) -> RoundPlan | None:
        """The round's plan once every member's part is in (alike on every member)."""
        if self.plan is not None or self.failed is not None:
            return self.plan
        if len(self._parts) < len(self.members):
            return None
        replica = self.rounds.merge.pipeline.replica
        if (replica.num_applied, replica.applied_digest()) != self.base:
            self._fail("replica_moved")
            return None
        gram = summed_gram([self._parts[m] for m in self.members])
        num_states = len(state_tensors(replica))
        problem = round_problem(self.incoming, gram, num_states)
        if problem is not None:
            self._fail(problem)
            return None
        try:
            self.plan = self.rounds.decide(self.incoming, gram, until_fold=self.until_fold)
        except CapUndecided:
            self._fail("cap_undecided")
        return self.plan

    def sums(self) -> list[torch.Tensor] | None:
        """This member's slices of the plan's weighted sums (None before the plan), in fp32:
        every member applies the same gathered values, bit for bit, and replicas of other
        groups that applied the same set in other rounds (or one by one) end within fp32
        rounding of them, inside the settle's tolerance (session 24: bf16 sums left groups
        ~4e-4 apart, a state download each at the end)."""
        if self.plan is None or self.failed is not None:
            return None
        mine = ShardRound.weighted_sums(self.plan, self._slices())
        self._sums[self.me] = mine
        return mine

    def sums_from(self, member: str, sums: Sequence[torch.Tensor]) -> bool:
        """Another member's slices of the sums; False when they fail their checks, or when
        this replica moved since the round's base ("replica_moved", nobody's fault: they are
        checked against this replica's state, which no longer is the one the member's part
        was; session 24's bench blamed two honest members for a whole fetch applied here
        mid-round)."""
        if self.plan is None or member not in self._parts or self.failed is not None:
            return False
        if member in self._sums:
            return False
        part = self._parts[member]
        with self.rounds.merge.pipeline.replica.lock:
            if self._moved():
                return False
            problem = sums_problem(self.plan, part, list(sums), self._states(member))
        if problem is not None:
            return self._fail(f"{problem} from {member}")
        self._sums[member] = list(sums)
        return True

    def apply(self) -> list[MergeResult] | None:
        """Applies the round once every member's slices are in (None before, or failed)."""
        if self.plan is None or self.failed is not None:
            return None
        if len(self._sums) < len(self.members):
            return None
        gathered = [
            torch.cat([self._sums[m][k] for m in self.members])
            for k in range(len(self.plan.combos))
        ]
        try:
            return self.rounds.apply(self.plan, gathered)
        except ValueError:
            self._fail("replica_moved")
            return None

    def _states(self, member: str) -> list[torch.Tensor]:
        start, end = self.bounds[member]
        return [t[start:end] for t in state_tensors(self.rounds.merge.pipeline.replica)]

    def _slices(self) -> list[torch.Tensor]:
        """This member's slice of every update in id order (zeros for one refused by its
        headers: its coefficients are 0)."""
        start, end = self.slice
        zeros = torch.zeros(end - start)
        return [self._shards.get(i, zeros) for i in range(len(self.incoming))]

    def _moved(self) -> bool:
        """Whether the replica left the round's base (then the round fails: "replica_moved")."""
        replica = self.rounds.merge.pipeline.replica
        if (replica.num_applied, replica.applied_digest()) != self.base:
            return not self._fail("replica_moved")
        return False

    def _fail(self, reason: str) -> bool:
        if self.failed is None:
            self.failed = reason
        return False
