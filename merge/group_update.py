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
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from enum import Enum

import torch

from merge.envelope import UpdateHeader
from merge.group_plan import ShardPlan, sharded_statement
from merge.identity import Identity, verify_signature

_CONTRIBUTION_TAG = b"diloco-group-contribution-v1\x00"
_SHARD_TAG = b"diloco-group-shard-v1\x00"
SIGNATURE_BYTES = 64
GROUP_AUTHOR_PREFIX = "groups.0b"
"""How every group key begins (dht.grouping's `groups.0b0110`): a replica applies a group
update only from members inside its key's prefix, so no other key is ever a group author,
and a solo author (a peer id its signature verifies) never begins so."""


class Phase(Enum):
    COLLECTING = "collecting"
    REDUCING = "reducing"
    COMPLETED = "completed"
    ABANDONED = "abandoned"


@dataclass(frozen=True, kw_only=True)
class ReductionConfig:
    """How a group reduction decides; part of the run's settings."""

    quorum_share: float = 0.5
    """Share of the group's members that must contribute by the deadline, else abandon."""
    max_retries: int = 1
    """Times the reduction restarts without a member lost while reducing, then abandons."""
    max_norm_to_median: float = 4.0
    """A contribution's norm is clipped to this times the median of the included members'
    signed norms (with 3 or more included; 0: off)."""

    def __post_init__(self) -> None:
        if not isinstance(self.quorum_share, int | float) or not 0 < self.quorum_share <= 1:
            raise ValueError(f"quorum_share must be in (0, 1], got {self.quorum_share!r}.")
        if type(self.max_retries) is not int or self.max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {self.max_retries!r}.")
        ratio = self.max_norm_to_median
        if not isinstance(ratio, int | float) or not (math.isfinite(ratio) and ratio >= 0):
            raise ValueError(f"max_norm_to_median must be a finite number >= 0, got {ratio!r}.")

    def quorum(self, num_members: int) -> int:
        """Contributions a group of `num_members` needs by the deadline (at least one)."""
        return max(1, math.ceil(self.quorum_share * num_members))


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a flat fp32 tensor's little-endian bytes."""
    data = tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
    return hashlib.sha256(data.tobytes()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class ContributionHeader:
    """What one member signs about its pseudo-gradient for one group round."""

    run_id: str
    author: str
    group_key: str
    epoch: int
    round: int
    learners: int
    """The epoch's learner count (non-empty groups) that sizes the group's update."""
    base_applied: int
    published_applied: int
    tokens: int
    norm: float
    digest: str
    signature: bytes = b""

    def signing_bytes(self) -> bytes:
        signed = {name: getattr(self, name) for name in _SIGNED_FIELDS}
        return _CONTRIBUTION_TAG + json.dumps(signed, sort_keys=True).encode()

    def wire_bytes(self) -> int:
        """Bytes the header takes on the wire: its signed fields and the signature."""
        return len(self.signing_bytes()) + SIGNATURE_BYTES

    def signed(self, identity: Identity) -> ContributionHeader:
        if identity.peer_id != self.author:
            raise ValueError("a contribution is signed by its author.")
        return replace(self, signature=identity.sign(self.signing_bytes()))

    @functools.cached_property
    def _verified(self) -> bool:
        return verify_signature(self.author, self.signing_bytes(), self.signature)

    def verified(self) -> bool:
        """Whether the author signed these fields (checked once per parsed header)."""
        return self._verified

    @classmethod
    def of(
        cls, pseudo_gradient: torch.Tensor, identity: Identity, round_: RoundFields, tokens: int
    ) -> ContributionHeader:
        """The signed header of ``identity``'s ``pseudo_gradient`` (its norm and digest)."""
        header = cls(
            **round_.__dict__,
            author=identity.peer_id,
            tokens=tokens,
            norm=float(torch.linalg.vector_norm(pseudo_gradient)),
            digest=tensor_digest(pseudo_gradient),
        )
        return header.signed(identity)


@dataclass(frozen=True, kw_only=True)
class RoundFields:
    """What a member of a group round signs: alike for every member but the applied counts
    (its own replica's, at its round's start and at its contribution)."""

    run_id: str
    group_key: str
    epoch: int
    round: int
    learners: int
    base_applied: int
    published_applied: int


_SIGNED_FIELDS = tuple(
    f.name for f in dataclasses.fields(ContributionHeader) if f.name != "signature"
)


def shard_statement(
    headers: tuple[ContributionHeader, ...], shard: int, shard_digest: str
) -> bytes:
    """What the reducer of ``shard`` co-signs: the round, who is included, its shard."""
    first = headers[0]
    fields = (first.run_id, first.group_key, first.epoch, first.round)
    return included_statement(fields, [h.author for h in headers], shard, shard_digest)


def included_statement(
    round_fields: tuple[str, str, int, int], included: list[str], shard: int, shard_digest: str
) -> bytes:
    """`shard_statement` from the round ((run id, group key, epoch, round)) and the included
    members alone: what a proof of a group's equivocation (merge.group_equivocation) holds."""
    run_id, group_key, epoch, round_ = round_fields
    signed = {
        "run_id": run_id,
        "group_key": group_key,
        "epoch": epoch,
        "round": round_,
        "included": included,
        "shard": shard,
        "shard_digest": shard_digest,
    }
    return _SHARD_TAG + json.dumps(signed, sort_keys=True).encode()


@dataclass(frozen=True)
class GroupUpdate:
    """One group's update for one round, applied by replicas as one unit."""

    contributions: tuple[ContributionHeader, ...]
    """The included members' signed headers, sorted by author; member i reduced shard i."""
    shard_digests: tuple[str, ...]
    cosignatures: tuple[bytes, ...]
    aggregate: torch.Tensor = field(compare=False)
    members: tuple[str, ...] = ()
    """Reduce-scatter (merge.group_shards): the epoch's member list the split is fixed by,
    one shard per member; shard k co-signed by its reducer (`ShardPlan.reducers`). Empty:
    one shard per included member, member i co-signing shard i (session 10)."""

    @property
    def update_id(self) -> str:
        first = self.contributions[0]
        return f"{first.group_key}/{first.epoch}/{first.round}"

    @property
    def tokens(self) -> int:
        return sum(h.tokens for h in self.contributions)

    @property
    def head(self) -> ContributionHeader:
        """The fields every contribution agrees on (group, round, learners)."""
        return self.contributions[0]

    @property
    def seq(self) -> int:
        """The update's seq under its group key as author: its round, counted from 1."""
        return self.head.round + 1

    @property
    def staleness(self) -> int:
        """The median of the included members' signed staleness (updates their replica
        applied between their round's start and their contribution; the lower median):
        one member claiming a stale or fresh round moves it no more than one of g."""
        stalenesses = sorted(
            max(0, h.published_applied - h.base_applied) for h in self.contributions
        )
        return stalenesses[(len(stalenesses) - 1) // 2]

    def update_header(self, fingerprint: str, inner_steps: int) -> UpdateHeader:
        """The header replicas weigh and record the group update by (merge.group_pipeline):
        author the group key, seq its round + 1, the tokens of its mean member (the aggregate
        is a mean), sized by the epoch's learner count (groups), its staleness the members'
        median (applied counts: the highest a member signed, and that minus the staleness).
        ``inner_steps``: the run's H (informational: members' steps are not signed)."""
        head = self.head
        published = max(h.published_applied for h in self.contributions)
        return UpdateHeader(
            fingerprint=fingerprint,
            author=head.group_key,
            seq=self.seq,
            base_applied=max(0, published - self.staleness),
            published_applied=published,
            inner_steps=inner_steps,
            tokens=max(1, round(self.tokens / len(self.contributions))),
            loss=0.0,
            payload_sha256=tensor_digest(self.aggregate),
            codec="fp32",
            numel=self.aggregate.numel(),
            created_at=0.0,
            learners=head.learners,
        )

    def header_bytes(self) -> int:
        """Bytes of everything but the aggregate's payload: headers, digests, co-signatures."""
        digests = sum(len(d) for d in self.shard_digests)
        return (
            sum(h.wire_bytes() for h in self.contributions)
            + digests
            + SIGNATURE_BYTES * len(self.cosignatures)
            + sum(len(m) + 3 for m in self.members)
        )

    def reducers(self) -> tuple[str, ...]:
        """Who reduced (and co-signed) each shard."""
        if not self.members:
            return tuple(h.author for h in self.contributions)
        return ShardPlan(self.members).reducers(h.author for h in self.contributions)

    @property
    def num_shards(self) -> int:
        """Shards the aggregate is split into and co-signed by: one per listed member
        (reduce-scatter), else one per included member."""
        return len(self.members) if self.members else len(self.contributions)

    def problem(self, in_group: Callable[[str], bool]) -> str | None:
        """Why a replica must refuse this update (a counted rejection), or None.

        ``in_group(peer_id)``: whether the peer belongs to the update's group (a pure function
        of its peer id, dht.grouping). Checks every signature, that the contributions agree on
        what the whole update is sized and weighed with, and that each shard is the one its
        reducer co-signed."""
        shards = self.num_shards
        if not self.contributions or len(self.shard_digests) != shards:
            return "malformed"
        if self.aggregate.dim() != 1:
            return "malformed"
        if self.members and list(self.members) != sorted(set(self.members)):
            return "malformed"
        if not bool(torch.isfinite(self.aggregate).all()):
            return "not_finite"
        problem = self.header_problem(in_group)
        if problem is not None:
            return problem
        for i, piece in enumerate(torch.tensor_split(self.aggregate, shards)):
            problem = self.shard_problem(i, piece)
            if problem is not None:
                return problem
        return None

    def header_problem(self, in_group: Callable[[str], bool]) -> str | None:
        """`problem`'s checks of everything but the aggregate: what a member that fetches
        only some shards (merge.shard_fetch) checks before any of them."""
        headers = self.contributions
        shards = self.num_shards
        if not headers or len(self.shard_digests) != shards:
            return "malformed"
        if self.members and list(self.members) != sorted(set(self.members)):
            return "malformed"
        if len(self.cosignatures) != shards:
            return "missing_cosignature"
        if [h.author for h in headers] != sorted({h.author for h in headers}):
            return "duplicate_or_unsorted_authors"
        if any(_shared(h) != _shared(headers[0]) for h in headers):
            return "headers_disagree"
        if not all(in_group(h.author) for h in headers):
            return "not_a_member"
        if self.members and not (
            {h.author for h in headers} <= set(self.members) and all(map(in_group, self.members))
        ):
            return "not_a_member"
        if any(not 0 <= h.base_applied <= h.published_applied for h in headers):
            return "bad_counters"
        if not all(h.verified() for h in headers):
            return "bad_signature"
        return None

    def shard_problem(self, shard: int, piece: torch.Tensor) -> str | None:
        """Why `piece` is not shard `shard` as its reducer co-signed it, or None (the headers
        checked first: `header_problem`)."""
        if tensor_digest(piece) != self.shard_digests[shard]:
            return "shard_mismatch"
        reducer = self.reducers()[shard]
        statement = self.statement(shard, self.shard_digests[shard])
        if not verify_signature(reducer, statement, self.cosignatures[shard]):
            return "bad_cosignature"
        return None

    def statement(self, shard: int, digest: str) -> bytes:
        """What the reducer of `shard` co-signed."""
        headers = self.contributions
        if not self.members:
            return shard_statement(headers, shard, digest)
        h = headers[0]
        fields = (h.run_id, h.group_key, h.epoch, h.round)
        return sharded_statement(fields, [x.author for x in headers], self.members, shard, digest)


def is_group_author(author: str) -> bool:
    """Whether an applied update's author is a learner group's key (not a peer id)."""
    return author.startswith(GROUP_AUTHOR_PREFIX)


def clip_scales(norms: list[float], config: ReductionConfig) -> list[float]:
    """Each included contribution's scale: its signed norm clipped to `max_norm_to_median` x
    the median signed norm (with 3 or more included): from signed headers alone, so every
    reducer of any shard scales a member's part alike."""
    bound = config.max_norm_to_median * statistics.median(norms)
    clip = len(norms) >= 3 and bound > 0
    return [bound / norm if clip and norm > bound else 1.0 for norm in norms]


NORM_BOUND_SLACK = 1.01
"""`signed_norm_bound`'s widening: bf16 rounding of the mean (2^-8 relative) and of the
parts sent in bf16, and float error."""


def signed_norm_bound(update: GroupUpdate, config: ReductionConfig) -> float:
    """A bound on the norm of `update`'s aggregate from its signed headers alone: the mean of
    its included members' signed norms, each clipped as the reduction clips it (`clip_scales`,
    ``config``: the run's), widened by NORM_BOUND_SLACK (the aggregate is the mean of the
    clipped parts: the triangle inequality). inf when a signed norm is not a finite number
    >= 0. Every replica refuses a group update over the norm cap by this bound, never by the
    aggregate's own norm, so the refusal is the same whether a replica holds the aggregate
    whole or its group sums per-part figures (merge.shard_round; docs/scale.md, Session 16)."""
    norms = [h.norm for h in update.contributions]
    if not norms or not all(math.isfinite(n) and n >= 0 for n in norms):
        return math.inf
    scales = clip_scales(norms, config)
    clipped = math.fsum(n * s for n, s in zip(norms, scales, strict=True))
    return clipped / len(norms) * NORM_BOUND_SLACK


def clipped_mean(
    tensors: list[torch.Tensor], norms: list[float], config: ReductionConfig
) -> torch.Tensor:
    """The mean of `tensors` (whole parts, or one shard of each) scaled by `clip_scales`;
    rounded to bf16 when every one of them holds bf16 values (parts sent in bf16)."""
    total = torch.zeros_like(tensors[0])
    for tensor, scale in zip(tensors, clip_scales(norms, config), strict=True):
        total.add_(tensor, alpha=scale)
    mean = total.div_(len(tensors))
    if all(_holds_bf16(t) for t in tensors):
        return mean.to(torch.bfloat16).to(torch.float32)
    return mean


def _holds_bf16(tensor: torch.Tensor) -> bool:
    """Whether every value of `tensor` is a bfloat16 value (a part sent in bf16)."""
    return torch.equal(tensor.to(torch.bfloat16).to(torch.float32), tensor)


def _shared(h: ContributionHeader) -> tuple[object, ...]:
    """What every contribution of one round signs alike (each member signs its own replica's
    applied counts: the group's staleness is their median)."""
    return (h.run_id, h.group_key, h.epoch, h.round, h.learners)


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
        member out (its part came late to the others): the caller checks `included`."""
        this_round = f"{self.group_key}/{self.epoch}/{self.round}"
        if self.outcome is not None or update.update_id != this_round:
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
        shards = torch.tensor_split(self._aggregate, len(included))
        self._digests = tuple(tensor_digest(s) for s in shards)

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
