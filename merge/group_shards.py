"""A learner group's round by reduce-scatter: each member reduces its shards, the group shares
the reduced shards. Pure: no network, no clock (docs/scale.md, session 12).

The update is split by the epoch's member list (merge.group_plan.ShardPlan) on the chunk grid
(merge.group_chunks: a shard's digest is the root of its chunks' digests, session 27). A member
signs its part's shard digests (`sharded_contribution`: the header's `digest` is their root)
and sends shard j, with its header and the digest list, to member j only: (M - 1) / M of a part
out, about one part in, per member and round, whatever the group's size. At the deadline the
included set is whoever's header (and pieces) came in; each included member reduces the shards
`ShardPlan.reducers` names it for (its own, and those of members not included: their pieces are
re-sent to it, `ShardPlan.sends`), co-signs each reduced shard and sends it to the other
included members, which assemble the group update once every shard is in (the all-gather: about
one update in per member). A member lost while reducing makes the round retry once without it
(its shards move to survivors, whose pieces are re-sent there; co-signatures of the earlier
attempt name another included set and do not count), or abandon, as
merge.group_update.GroupReduction does; never half-applied.

Folded (`fold`, `--group-fold`, docs/scale.md Session 29): a reducer sends each reduced shard's
values to its replica holder only (merge.shard_holders: the next included member) and its
co-signature over the shard's digest to the others (`take_reduced` with `digest` and no
tensor); the round completes once every shard's co-signature is in, and its outcome is this
member's `ShardHolding` (the update's co-signed fields and the shards it holds, each checked
against its digest), not a whole update: the own update is then a candidate of the members'
fetch round (dht.group_exchange_fetch).

`ShardedReduction` is one member's view (the pieces of the shards it reduces, the reduced
shards of the others) or, given every piece, the whole group's (the simulator). Every input
is checked against its author's signature; a refusal is counted in `rejected`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

import torch

from merge.group_chunks import shard_digest, shard_digests
from merge.group_plan import ShardPlan
from merge.group_update import (
    Abandoned,
    ContributionHeader,
    GroupUpdate,
    Phase,
    ReductionConfig,
    RoundFields,
    _shared,
    clipped_mean,
)
from merge.identity import Identity, verify_signature
from merge.shard_holders import ShardHolding
from merge.shard_proof import ProofError, ShardProof, merkle_root

Outcome = GroupUpdate | ShardHolding | Abandoned
"""A sharded round's end: the whole update, a folded round's holding, or abandoned."""


def sharded_contribution(
    pseudo_gradient: torch.Tensor,
    identity: Identity,
    round_: RoundFields,
    tokens: int,
    num_shards: int,
) -> tuple[ContributionHeader, tuple[str, ...]]:
    """The signed header of a part sent by shards (its digest the Merkle root of its shard
    digests, merge.shard_proof, session 28; each the root of its chunks' digests:
    merge.group_chunks `shard_digest`) and the shard digests, of which each piece carries its
    own with its path to the root."""
    digests = shard_digests(pseudo_gradient, num_shards)
    header = ContributionHeader.of(pseudo_gradient, identity, round_, tokens)
    return replace(header, digest=merkle_root(digests)).signed(identity), digests


class ShardedReduction:
    """One group round by reduce-scatter, driven by events (see the module's docstring).

    `contribute` a member's signed header with its shard digests, `take_piece` its pieces
    (before the deadline, or re-sent after it to a reducer that took the shard over), `close`
    at the deadline, `reduce` each shard this view reduces once `ready`, `take_reduced` each
    reduced shard with its reducer's co-signature, `lose` a reducer that died with its shards
    missing. `outcome` is set once: a complete GroupUpdate or Abandoned."""

    def __init__(
        self,
        *,
        group_key: str,
        epoch: int,
        round: int,
        members: Iterable[str],
        numel: int,
        config: ReductionConfig | None = None,
        fold: bool = False,
    ) -> None:
        """`fold`: the round completes on co-signatures alone (see the module's docstring)."""
        self.group_key, self.epoch, self.round = group_key, epoch, round
        self.fold = fold
        self.plan = ShardPlan.of(members)
        self.members = frozenset(self.plan.members)
        self.numel = numel
        self.bounds = self.plan.bounds(numel)
        self.config = config or ReductionConfig()
        self.phase = Phase.COLLECTING
        self.outcome: Outcome | None = None
        self.retries = 0
        self.rejected: dict[str, int] = {}
        self._headers: dict[str, ContributionHeader] = {}
        self._digests: dict[str, dict[int, str]] = {}
        """The shard digests of each contributor's part this view holds proven."""
        self._pieces: dict[int, dict[str, torch.Tensor]] = {}
        self._included: tuple[str, ...] = ()
        self._reducers: tuple[str, ...] = ()
        self._reduced: dict[int, tuple[torch.Tensor | None, str, bytes]] = {}
        """Shard -> (its values, None for a seal; its digest; its reducer's co-signature)."""
        self._held: dict[int, tuple[tuple[str, ...], torch.Tensor | None, bytes, str | None]] = {}
        """Reduced shards for another included set (an attempt this view has not reached)."""
        self._values: dict[tuple[int, str], torch.Tensor] = {}
        """(shard, digest) -> the reduced values this view had of it, of any attempt, kept
        while the round runs (`values_for`: a member adopting a folded update another member
        completed serves what it held, session 30)."""

    # ---- views ------------------------------------------------------------------------------

    @property
    def included(self) -> tuple[str, ...]:
        return self._included

    @property
    def reducers(self) -> tuple[str, ...]:
        """The reducer of each shard for the current attempt (empty while collecting)."""
        return self._reducers

    @property
    def contributors(self) -> frozenset[str]:
        return frozenset(self._headers)

    @property
    def quorum(self) -> int:
        return self.config.quorum(len(self.members))

    def shards_of(self, member: str) -> tuple[int, ...]:
        return tuple(j for j, r in enumerate(self._reducers) if r == member)

    def missing_shards(self) -> list[int]:
        """Shards whose reduced value (co-signed) is not in yet, for the current attempt."""
        if self.phase is not Phase.REDUCING:
            return []
        return [j for j in range(self.plan.num_shards) if j not in self._reduced]

    def missing_reducers(self) -> list[str]:
        """Reducers with a shard not in yet: the ones whose loss makes the round retry."""
        return sorted({self._reducers[j] for j in self.missing_shards()})

    def holds_values(self, shard: int, included: tuple[str, ...]) -> bool:
        """Whether this view holds `shard`'s reduced values of the attempt over `included`
        (in a folded round's outcome once it completed): what a replica holder answers the
        shard's reducer (dht.grouping_shards `ShardedRound.replica_took`)."""
        if included != self._included:
            return False
        if isinstance(self.outcome, ShardHolding):
            return shard in self.outcome.shards
        got = self._reduced.get(shard)
        return self.phase is Phase.REDUCING and got is not None and got[0] is not None

    def remember(self, shard: int, digest: str, values: torch.Tensor) -> None:
        """Keeps `values` (shard `shard`'s reduced values, `digest` computed from them) for
        `values_for` while the round runs (bounded: a few attempts' worth); folded rounds
        only (a round not folded ends with the update whole at every member)."""
        if self.fold and self.outcome is None and len(self._values) < 4 * self.plan.num_shards:
            self._values[(shard, digest)] = values

    def values_for(self, fields: GroupUpdate) -> dict[int, torch.Tensor]:
        """The reduced shards' values this running round had, of any attempt, that are
        shards of `fields` (their digests the ones `fields` names): what this member holds of
        a variant another member completed (session 30: a member that retried or timed out
        while the other completed on seals held the values of a shard nobody else did)."""
        if self.outcome is not None or len(fields.shard_digests) != self.plan.num_shards:
            return {}
        return {
            k: values
            for (k, digest), values in self._values.items()
            if fields.shard_digests[k] == digest
        }

    def ready(self, shard: int) -> bool:
        """Whether this view holds shard `shard`'s piece of every included member."""
        held = self._pieces.get(shard, {})
        return self.phase is Phase.REDUCING and all(m in held for m in self._included)

    def header_of(self, author: str) -> ContributionHeader | None:
        return self._headers.get(author)

    def count(self, reason: str) -> bool:
        """Counts a refusal of the caller's (always False)."""
        return self._count(reason)

    def piece_of(self, author: str, shard: int) -> torch.Tensor | None:
        return self._pieces.get(shard, {}).get(author)

    # ---- collecting -------------------------------------------------------------------------

    def contribute(self, header: ContributionHeader, digests: tuple[str, ...] | ShardProof) -> bool:
        """A member's signed header with its part's shard digests (all of them, or one and its
        path to the header's root); False (counted) if refused."""
        reason = self._refusal(header, digests)
        if reason is not None:
            return self._count(reason)
        self._headers[header.author] = header
        self._digests[header.author] = {}
        return self._learn(header.author, digests)

    def take_proof(self, author: str, proof: ShardProof) -> bool:
        """Another shard's digest of a contributor's part, with its path to the signed root
        (a piece re-sent after the deadline to the shard's new reducer); counted if refused."""
        header = self._headers.get(author)
        if header is None:
            return self._count("piece_without_header")
        if self._proves(header, proof) is not None:
            return self._count("wrong_shards")
        return self._learn(author, proof)

    def _learn(self, author: str, digests: tuple[str, ...] | ShardProof) -> bool:
        if isinstance(digests, ShardProof):
            self._digests[author][digests.shard] = digests.digest
        else:
            self._digests[author].update(enumerate(digests))
        return True

    def _proves(
        self, header: ContributionHeader, digests: tuple[str, ...] | ShardProof
    ) -> str | None:
        count = digests.count if isinstance(digests, ShardProof) else len(digests)
        if count != self.plan.num_shards:
            return "wrong_shards"
        try:
            root = digests.root() if isinstance(digests, ShardProof) else merkle_root(digests)
        except (ProofError, ValueError):
            return "wrong_shards"
        return None if root == header.digest else "wrong_shards"

    def _refusal(
        self, header: ContributionHeader, digests: tuple[str, ...] | ShardProof
    ) -> str | None:
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
        if header.author in self._headers:
            return "duplicate"
        first = next(iter(self._headers.values()), None)
        if first is not None and _shared(header) != _shared(first):
            return "headers_disagree"
        if self._proves(header, digests) is not None:
            return "wrong_shards"
        if not header.verified():
            return "bad_signature"
        return None

    def take_piece(self, author: str, shard: int, piece: torch.Tensor) -> bool:
        """Shard `shard` of `author`'s part (its header in first); False (counted) if refused.
        Taken until the outcome is set: a re-sent piece comes after the deadline."""
        if self.outcome is not None:
            return self._count("settled")
        if author not in self._digests:
            return self._count("piece_without_header")
        if self.phase is Phase.REDUCING and author not in self._included:
            return self._count("piece_not_included")
        if not 0 <= shard < self.plan.num_shards:
            return self._count("bad_shard")
        start, end = self.bounds[shard]
        if piece.dim() != 1 or piece.numel() != end - start:
            return self._count("wrong_size")
        if not bool(torch.isfinite(piece).all()):
            return self._count("not_finite")
        signed = self._digests[author].get(shard)
        if signed is None:
            return self._count("piece_without_proof")
        if shard_digest(piece, self.numel, start) != signed:
            return self._count("bad_piece")
        self._pieces.setdefault(shard, {})[author] = piece.detach().to(torch.float32).clone()
        return True

    def close(self) -> Phase:
        """The deadline: included is whoever contributed; below quorum, abandon."""
        if self.phase is Phase.COLLECTING:
            self._start(tuple(sorted(self._headers)))
        return self.phase

    # ---- reducing ---------------------------------------------------------------------------

    def reduce(self, shard: int) -> torch.Tensor:
        """Shard `shard` of the group's update: the mean of the included members' pieces,
        each scaled by its author's signed norm (merge.group_update.clip_scales)."""
        if not self.ready(shard):
            raise ValueError(f"shard {shard} is not ready to reduce.")
        held = self._pieces[shard]
        norms = [self._headers[m].norm for m in self._included]
        return clipped_mean([held[m] for m in self._included], norms, self.config)

    def statement(self, shard: int, reduced: torch.Tensor) -> bytes:
        """What the reducer of `shard` co-signs for the current attempt."""
        if self.phase is not Phase.REDUCING:
            raise ValueError("only a reduction in progress has statements to co-sign.")
        start = self.bounds[shard][0]
        return self._draft().statement(shard, shard_digest(reduced, self.numel, start))

    def take_reduced(
        self,
        shard: int,
        reduced: torch.Tensor | None,
        signature: bytes,
        included: tuple[str, ...] | None = None,
        digest: str | None = None,
    ) -> bool:
        """A reduced shard and its reducer's co-signature (`included`: the included set it
        was reduced over; None: this view's), or, folded, its co-signature over `digest`
        alone (`reduced` None: a seal). One for another included set is held until this view
        reaches it. The last shard in completes the round."""
        if self.outcome is not None:
            return False
        if not 0 <= shard < self.plan.num_shards:
            return self._count("bad_shard")
        if reduced is None and (digest is None or not self.fold):
            return self._count("seal_not_folded")
        start, end = self.bounds[shard]
        if reduced is not None:
            if reduced.dim() != 1 or reduced.numel() != end - start:
                return self._count("wrong_size")
            if not bool(torch.isfinite(reduced).all()):
                return self._count("not_finite")
            reduced = reduced.detach().to(torch.float32).clone()
            digest = shard_digest(reduced, self.numel, start)
        assert digest is not None
        if reduced is not None:
            self.remember(shard, digest, reduced)
        if included is not None and included != self._included:
            self._held[shard] = (included, reduced, signature, digest)
            return True
        if self.phase is not Phase.REDUCING:
            return self._count("not_reducing")
        reducer = self._reducers[shard]
        if not verify_signature(reducer, self._draft().statement(shard, digest), signature):
            return self._count("bad_cosignature")
        if reduced is None and shard in self._reduced:
            return True  # the values came first (a replica holder): kept
        self._reduced[shard] = (reduced, digest, signature)
        if len(self._reduced) == self.plan.num_shards:
            self._complete()
        return True

    def lose(self, member: str) -> Phase:
        """`member` died (or froze) with a shard of the current attempt not in: the round
        retries once without it (its shards move to the survivors), or abandons. A reducer
        whose shards are all in has done its part and is not lost."""
        return self.lose_all((member,))

    def lose_all(self, members: Iterable[str]) -> Phase:
        """`lose` for several reducers found lost at once (one retry without all of them)."""
        lost = set(members) & set(self.missing_reducers())
        if self.phase is Phase.REDUCING and lost:
            if self.retries >= self.config.max_retries:
                self._abandon("reducer_lost")
            else:
                self.retries += 1
                self._start(tuple(m for m in self._included if m not in lost))
        return self.phase

    def can_retry_without(self, members: Iterable[str]) -> bool:
        """Whether losing `members` (reducers with a shard missing) would retry, not abandon:
        a retry left and a quorum without them."""
        lost = set(members) & set(self.missing_reducers())
        kept = [m for m in self._included if m not in lost]
        return bool(lost) and self.retries < self.config.max_retries and len(kept) >= self.quorum

    def expire(self) -> Phase:
        """The co-sign deadline passed with shards missing: abandon."""
        if self.phase is Phase.REDUCING:
            self._abandon("cosign_timeout")
        return self.phase

    def adopt(self, update: GroupUpdate) -> bool:
        """Another member's complete update of this round (its included set differs from
        this view's): taken before the outcome is set, if valid, sharded by this member list,
        and its headers match those this view holds."""
        this_round = f"{self.group_key}/{self.epoch}/{self.round}"
        if self.outcome is not None or update.update_id != this_round:
            return False
        if update.members != self.plan.members:
            return False
        theirs = {h.author: h for h in update.contributions}
        if any(theirs[a] != h for a, h in self._headers.items() if a in theirs):
            return False
        if update.problem(self.members.__contains__) is not None:
            return False
        self.outcome, self.phase = update, Phase.COMPLETED
        self._values = {}
        return True

    # ---- internals --------------------------------------------------------------------------

    def _draft(self) -> GroupUpdate:
        """An update of the current attempt with no shards yet: its statements."""
        headers = tuple(self._headers[m] for m in self._included)
        return GroupUpdate(headers, (), (), torch.zeros(0), self.plan.members)

    def _start(self, included: tuple[str, ...]) -> None:
        self._included, self._reduced = included, {}
        if len(included) < self.quorum:
            self._abandon("below_quorum")
            return
        self.phase = Phase.REDUCING
        self._reducers = self.plan.reducers(included)
        for shard, (theirs, reduced, signature, digest) in list(self._held.items()):
            if theirs == included:
                del self._held[shard]
                self.take_reduced(shard, reduced, signature, digest=digest)
                if self.outcome is not None:
                    return

    def _complete(self) -> None:
        shards = [self._reduced[j] for j in range(self.plan.num_shards)]
        values = [t for t, _, _ in shards]
        fields = GroupUpdate(
            tuple(self._headers[m] for m in self._included),
            tuple(d for _, d, _ in shards),
            tuple(s for _, _, s in shards),
            torch.zeros(0),
            self.plan.members,
        )
        if self.fold:
            held = {j: t for j, t in enumerate(values) if t is not None}
            self.outcome = ShardHolding(fields, self.numel, held)
        else:
            whole = [t for t in values if t is not None]
            assert len(whole) == len(values), "a seal is taken only by a folded round"
            self.outcome = replace(fields, aggregate=torch.cat(whole))
        self.phase = Phase.COMPLETED
        self._pieces, self._held, self._values = {}, {}, {}

    def _abandon(self, reason: str) -> None:
        self.outcome, self.phase = Abandoned(reason), Phase.ABANDONED
        self._pieces, self._held, self._reduced, self._values = {}, {}, {}, {}

    def _count(self, reason: str) -> bool:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        return False
