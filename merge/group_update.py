"""A learner group's update: its members' signed contributions, reduced fault-tolerantly.

At a round's deadline the group's reduction decides once who is in: exactly the members whose
signed contribution arrived by then (a straggler is left out, never waited for). Fewer than
a quorum abandons the round. Each included member then reduces one shard of the aggregate
and co-signs it; a member lost while reducing makes the reduction retry once without it, or
abandon. So the outcome is either a complete :class:`GroupUpdate`, whose aggregate is the
mean of exactly its included contributions (each clipped to the in-group robust bound;
rounded to bf16 when every included part holds bf16 values, parts sent in bf16: a pure
function of the signed parts, so members whose codecs differ still agree) and which every
included member co-signed, or nothing: never half-applied. Replicas apply a group update as
one unit, id (group key, epoch, round).

Trust: the update carries each member's signed :class:`ContributionHeader` (author, tokens,
norm, digest of its pseudo-gradient, the group and round it is for, the learner count and
applied counts it sizes and weighs the update with) and one co-signature per included member
over the shard it reduced. docs/scale.md says why both. Pure: no network, no clock.

This module is the reduction (:class:`GroupReduction`); the signed contribution, the round's
statements and the in-group clip are merge.group_contribution, the complete update replicas
apply and check is merge.group_applied (split in session 24, code moved unchanged). Every
public name is re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import torch

from merge.group_applied import (
    GROUP_AUTHOR_PREFIX,
    NORM_BOUND_SLACK,
    GroupUpdate,
    is_group_author,
    signed_norm_bound,
)
from merge.group_chunks import shard_digests
from merge.group_contribution import (
    SIGNATURE_BYTES,
    ContributionHeader,
    ReductionConfig,
    RoundFields,
    _shared,
    clip_scales,
    clipped_mean,
    included_statement,
    shard_statement,
    tensor_digest,
)
from merge.identity import verify_signature

__all__ = [
    "GROUP_AUTHOR_PREFIX",
    "NORM_BOUND_SLACK",
    "SIGNATURE_BYTES",
    "Abandoned",
    "ContributionHeader",
    "GroupReduction",
    "GroupUpdate",
    "Phase",
    "ReductionConfig",
    "RoundFields",
    "clip_scales",
    "clipped_mean",
    "included_statement",
    "is_group_author",
    "shard_statement",
    "signed_norm_bound",
    "tensor_digest",
]
"""Callers import these here: the reduction's names, and those moved to merge.group_contribution
and merge.group_applied (session 24)."""


class Phase(Enum):
    COLLECTING = "collecting"
    REDUCING = "reducing"
    COMPLETED = "completed"
    ABANDONED = "abandoned"


@dataclass(frozen=True)
class Abandoned:
    reason: str


class GroupReduction:
    """One group round's reduction: collect until the deadline, then reduce or abandon.

    The caller drives it from events: :meth:`contribute` before the deadline, :meth:`close`
    at it, :meth:`lose` for a member that died while reducing, :meth:`cosign` as included
    members sign their shards. :attr:`outcome` is set once, and never changes after.
    """

    def __init__(
        self,
        *,
        group_key: str,
        epoch: int,
        round: int,
        members: Iterable[str],
        config: ReductionConfig | None = None,
    ) -> None:
        self.group_key, self.epoch, self.round = group_key, epoch, round
        self.members = frozenset(members)
        self.config = config or ReductionConfig()
        self.phase = Phase.COLLECTING
        self.outcome: GroupUpdate | Abandoned | None = None
        self.retries = 0
        self.rejected: dict[str, int] = {}
        self._contributions: dict[str, tuple[ContributionHeader, torch.Tensor]] = {}
        self._included: tuple[str, ...] = ()
        self._aggregate: torch.Tensor | None = None
        self._digests: tuple[str, ...] = ()
        self._cosignatures: dict[str, bytes] = {}

    @property
    def included(self) -> tuple[str, ...]:
        return self._included

    @property
    def contributors(self) -> frozenset[str]:
        """Members whose contribution is in (so far, or by the deadline once closed)."""
        return frozenset(self._contributions)

    @property
    def cosigned(self) -> frozenset[str]:
        """Included members whose co-signature of the current attempt is in."""
        return frozenset(self._cosignatures)

    @property
    def quorum(self) -> int:
        return self.config.quorum(len(self.members))

    def contribute(self, header: ContributionHeader, pseudo_gradient: torch.Tensor) -> bool:
        """Takes one member's contribution before the deadline; False (counted) if refused."""
        reason = self._refusal(header, pseudo_gradient)
        if reason is not None:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1
            return False
        self._contributions[header.author] = (header, pseudo_gradient.detach().clone())
        return True

    def _refusal(self, header: ContributionHeader, pseudo_gradient: torch.Tensor) -> str | None:
        if self.phase is not Phase.COLLECTING:
            return "after_deadline"
        if header.author not in self.members:
            return "not_a_member"
        if (header.group_key, header.epoch, header.round) != (
            self.group_key,
            self.epoch,
            self.round,
        ):
            return "wrong_round"
        if header.author in self._contributions:
            return "duplicate"
        if self._contributions and _shared(header) != _shared(
            next(iter(self._contributions.values()))[0]
        ):
            return "headers_disagree"
        if pseudo_gradient.dim() != 1 or not bool(torch.isfinite(pseudo_gradient).all()):
            return "not_finite"
        if tensor_digest(pseudo_gradient) != header.digest or not header.verified():
            return "bad_signature"
        return None

    def close(self) -> Phase:
        """The deadline: the included set is whoever contributed; below quorum, abandon."""
        if self.phase is Phase.COLLECTING:
            self._start_reducing(tuple(sorted(self._contributions)))
        return self.phase

    def lose(self, member: str) -> Phase:
        """A member died (or froze) while reducing: retry once without it, or abandon."""
        if self.phase is Phase.REDUCING and member in self._included:
            if self.retries >= self.config.max_retries:
                self._abandon("reducer_lost")
            else:
                self.retries += 1
                self._start_reducing(tuple(m for m in self._included if m != member))
        return self.phase

    def statement(self, member: str) -> bytes:
        """What ``member`` co-signs for the current attempt (it must be included)."""
        if self.phase is not Phase.REDUCING or self._aggregate is None:
            raise ValueError("only a reduction in progress has statements to co-sign.")
        shard = self._included.index(member)
        return shard_statement(self._headers(), shard, self._digests[shard])

    def cosign(self, member: str, signature: bytes) -> Phase:
        """Takes an included member's co-signature; the last one completes the reduction."""
        if self.phase is not Phase.REDUCING or member not in self._included:
            return self.phase
        if not verify_signature(member, self.statement(member), signature):
            self.rejected["bad_cosignature"] = self.rejected.get("bad_cosignature", 0) + 1
            return self.phase
        self._cosignatures[member] = signature
        if len(self._cosignatures) == len(self._included):
            self._complete()
        return self.phase

    def adopt(self, update: GroupUpdate) -> bool:
        """Another member completed this round first, with an included set this member's
        attempt no longer holds (it lost a member the other had the co-signature of): the
        other's update, which every included member co-signed, is this round's outcome.
        Only a complete, valid update of this round whose headers match the contributions
        this member holds is taken, before the outcome is set, never after. It may leave this
        member out (its part came late to the others): the caller checks `included`. One that
        includes fewer than this round's quorum is refused: no honest completer reduces below
        it (`_start_reducing` abandons there), and a lone member's variant of the round, all its
        own signatures, would otherwise end an honest member's round (session 24, rogue24)."""
        this_round = f"{self.group_key}/{self.epoch}/{self.round}"
        if self.outcome is not None or update.update_id != this_round:
            return False
        if len(update.contributions) < self.quorum:
            return False
        theirs = {h.author: h for h in update.contributions}
        if any(theirs[a] != h for a, (h, _) in self._contributions.items() if a in theirs):
            return False
        if update.problem(self.members.__contains__) is not None:
            return False
        self.outcome, self.phase, self._aggregate = update, Phase.COMPLETED, None
        return True

    def expire(self) -> Phase:
        """The co-signatures did not all come in time (a member froze, or the included sets
        disagreed): abandon. Nothing half-done is left: the outcome is Abandoned."""
        if self.phase is Phase.REDUCING:
            self._abandon("cosign_timeout")
        return self.phase

    def _start_reducing(self, included: tuple[str, ...]) -> None:
        self._included, self._cosignatures = included, {}
        if len(included) < self.quorum:
            self._abandon("below_quorum")
            return
        self.phase = Phase.REDUCING
        self._aggregate = self._mean_of_clipped(included)
        self._digests = shard_digests(self._aggregate, len(included))

    def _mean_of_clipped(self, included: tuple[str, ...]) -> torch.Tensor:
        norms = [self._contributions[m][0].norm for m in included]
        return clipped_mean([self._contributions[m][1] for m in included], norms, self.config)

    def _headers(self) -> tuple[ContributionHeader, ...]:
        return tuple(self._contributions[m][0] for m in self._included)

    def _complete(self) -> None:
        assert self._aggregate is not None
        self.outcome = GroupUpdate(
            self._headers(),
            self._digests,
            tuple(self._cosignatures[m] for m in self._included),
            self._aggregate,
        )
        self.phase = Phase.COMPLETED

    def _abandon(self, reason: str) -> None:
        self.outcome, self.phase, self._aggregate = Abandoned(reason), Phase.ABANDONED, None
