"""A learner group's complete update as replicas apply it: one unit, id (group key, epoch,
round), with every check a replica runs on it (`GroupUpdate.problem`: signatures,
co-signatures, agreement of the headers, membership) and the norm bound a replica refuses it
by (`signed_norm_bound`). Made by merge.group_update's :class:`GroupReduction`; moved out of
merge/group_update.py unchanged (session 24), which re-exports every public name. Pure: no
network, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from merge.envelope import UpdateHeader
from merge.group_chunks import aligned_bounds, shard_digest, slice_problem, split
from merge.group_contribution import (
    SIGNATURE_BYTES,
    ContributionHeader,
    ReductionConfig,
    _shared,
    clip_scales,
    shard_statement,
    tensor_digest,
)
from merge.group_plan import ShardPlan, sharded_statement
from merge.identity import verify_signature

GROUP_AUTHOR_PREFIX = "groups.0b"
"""How every group key begins (dht.grouping's `groups.0b0110`): a replica applies a group
update only from members inside its key's prefix, so no other key is ever a group author,
and a solo author (a peer id its signature verifies) never begins so."""


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
        for i, piece in enumerate(split(self.aggregate, shards)):
            problem = self.shard_problem(i, piece, self.aggregate.numel())
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

    def shard_bounds(self, numel: int) -> list[tuple[int, int]]:
        """[start, end) of each shard of the update's `numel` values (the chunk grid's split:
        merge.group_chunks `aligned_bounds`)."""
        return aligned_bounds(numel, self.num_shards)

    def shard_problem(self, shard: int, piece: torch.Tensor, numel: int) -> str | None:
        """Why `piece` is not shard `shard` (of an update of `numel` values) as its reducer
        co-signed it, or None (the headers checked first: `header_problem`): its digest is
        the root of its chunks' digests (`shard_digest`)."""
        start, end = self.shard_bounds(numel)[shard]
        if piece.dtype != torch.float32 or piece.shape != (end - start,):
            return "shard_size"
        if shard_digest(piece, numel, start) != self.shard_digests[shard]:
            return "shard_mismatch"
        return self.cosignature_problem(shard)

    def slice_problem(
        self, shard: int, digests: tuple[str, ...], start: int, piece: torch.Tensor, numel: int
    ) -> str | None:
        """Why `piece`, claimed to be the values [start, start + len) of shard `shard` (of an
        update of `numel` values; `digests` its chunk digests as the holder serves them), is
        not what its reducer co-signed, or None (merge.group_chunks `slice_problem`)."""
        bounds = self.shard_bounds(numel)[shard]
        root = self.shard_digests[shard]
        problem = slice_problem(numel, bounds, root, digests, start, piece)
        return problem or self.cosignature_problem(shard)

    def cosignature_problem(self, shard: int) -> str | None:
        """Why shard `shard`'s digest is not what its reducer co-signed, or None."""
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
