"""One member's side of a learner group's round by reduce-scatter (`--group-scatter`), and
its messages (their wire forms in dht.grouping_shard_wire, re-exported here); pure
(dht/group_exchange.py does the network). The decisions are merge.group_shards' and
merge.group_plan's.

- `group-piece` (`DGP5`; `DGP4` of session 27 and `DGP3` before it refused as "old_version"):
  a member's signed header, a shard index, that shard's digest (the root of its chunk digests:
  merge.group_chunks, whose grid cuts the shards) with its Merkle path to the header's digest
  (merge.shard_proof, session 28: ceil(log2 g) sibling hashes, where DGP4 carried all g
  digests) and that shard of its part in the swarm's codec. Sent to the shard's member before
  the deadline, to the shard's reducer after it when that is another member (one not included,
  or lost).
  A receiver checks the piece against its author's signature before keeping anything
  (`decode_piece`: GroupMessageError otherwise).
- `group-shard` (`DGS3`; `DGS2` of session 27 and `DGS1` refused as "old_version"): a reduced
  shard, the included set it was reduced over as a bitmap over the round's sorted member list
  (merge.shard_proof, session 28: g / 8 bytes, where DGS2 named each peer id) and its reducer's
  co-signature; sent to every other included member (the all-gather). The receiver decodes the
  bitmap over its own member list (`WireShard.over`) to the tuple the co-signature covers.
- `ShardedRound` drives `ShardedReduction` for this member from events with their time, as
  dht.grouping_round.GroupRound does for whole parts: pieces in until the deadline, its own
  reduced shards out once their pieces are in, the others' in; a reducer lost with a shard
  missing makes the round retry once without it; shards not all in by the co-sign deadline
  abandon it, unless they are one live reducer's (the deadline then moves once:
  dht.grouping_patience, session 14). A reducer this member's live view says is gone is lost
  only past the first co-sign deadline (session 18: views flap under load, and one member
  retrying alone split the round). Per member and round: about one part out and one in, plus
  one update in.
- Folded (`fold`, `--group-fold`, session 29): each reduced shard goes whole (`DGS3`) to its
  replica holder only (`replica_holder`: the next included member, merge.shard_holders) and
  as a seal (`DGS4`: its digest and co-signature, no values) to the other included members;
  the outcome is this member's `ShardHolding` (merge.group_shards). Session 30: a reducer's
  own shard counts here, and its seal goes out, only once the replica holder said it took the
  values (`replica_took`): a member that completes on seals then knows every shard is at two
  holders. Stop 47's CI run killed a reducer with its values in flight while a member
  completed on its seal: no live node held that shard, and the update was lost everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from dht.grouping_patience import CosignClock, round_deadlines
from dht.grouping_shard_wire import (
    OLD_MAGICS,
    PIECE_MAGIC,
    SEAL_MAGIC,
    SHARD_MAGIC,
    Piece,
    ReducedShard,
    WireShard,
    decode_piece,
    decode_shard,
    encode_piece,
    get_codec_bytes,
    piece_frame_bytes,
    piece_max_bytes,
    shard_codec,
    shard_frame_bytes,
    shard_max_bytes,
)
from dht.grouping_wire import RoundId
from merge.group_chunks import shard_digest, split
from merge.group_shards import Outcome, ShardedReduction
from merge.group_update import (
    ContributionHeader,
    GroupUpdate,
    Phase,
    ReductionConfig,
)
from merge.identity import Identity
from merge.shard_proof import ProofError

__all__ = [
    "OLD_MAGICS",
    "PIECE_MAGIC",
    "SEAL_MAGIC",
    "SHARD_MAGIC",
    "Piece",
    "ReducedShard",
    "WireShard",
    "decode_piece",
    "decode_shard",
    "encode_piece",
    "get_codec_bytes",
    "piece_frame_bytes",
    "piece_max_bytes",
    "shard_codec",
    "shard_frame_bytes",
    "shard_max_bytes",
    "ShardedRound",
]


class ShardedRound:
    """This member's side of one group round by reduce-scatter; pure: events in with their
    time, pieces and reduced shards to send out. `outcome`: a GroupUpdate, a folded
    round's ShardHolding, or Abandoned."""

    def __init__(
        self,
        identity: Identity,
        header: ContributionHeader,
        digests: tuple[str, ...],
        tensor: torch.Tensor,
        members: Iterable[str],
        *,
        opened_at: float,
        wait_s: float,
        cosign_s: float,
        config: ReductionConfig | None = None,
        grace_s: float = 0.0,
        fold: bool = False,
    ) -> None:
        """`grace_s`: how long past its `wait_s` join window the round keeps collecting
        (dht.grouping_patience.grace_s); the co-sign deadline stays `cosign_s` past the join
        window (at least the collection's end), so a round ends within the same bound."""
        self.me = identity.peer_id
        self._identity = identity
        self.members = frozenset(members)
        if self.me not in self.members or header.author != self.me:
            raise ValueError("a group round is opened by a member with its own contribution.")
        self.reduction = ShardedReduction(
            group_key=header.group_key,
            epoch=header.epoch,
            round=header.round,
            members=self.members,
            numel=tensor.numel(),
            config=config,
            fold=fold,
        )
        self.header, self.digests = header, digests
        self.pieces = split(tensor.detach().to(torch.float32), len(digests))
        self.deadline, first = round_deadlines(opened_at, wait_s, cosign_s, grace_s)
        self.clock = CosignClock(first, extension_s=cosign_s)
        self._sent: set[tuple[int, str]] = set()
        self._shared: set[tuple[tuple[str, ...], int]] = set()
        self._unheld: dict[tuple[tuple[str, ...], int], ReducedShard] = {}
        """Folded: this member's reduced shards (by attempt) whose replica holder has not
        said it took the values: not in here yet, no seal sent (`replica_took`)."""
        if not self.reduction.contribute(header, digests):
            raise ValueError(f"own contribution refused: {self.reduction.rejected}")
        for shard, piece in enumerate(self.pieces):
            self.reduction.take_piece(self.me, shard, piece)

    @property
    def cosign_deadline(self) -> float:
        """When the round abandons with shards missing (moved once for one late reducer)."""
        return self.clock.deadline

    @property
    def round_id(self) -> RoundId:
        r = self.reduction
        return (r.group_key, r.epoch, r.round)

    @property
    def phase(self) -> Phase:
        return self.reduction.phase

    @property
    def outcome(self) -> Outcome | None:
        return self.reduction.outcome

    @property
    def done(self) -> bool:
        return self.reduction.outcome is not None

    def others(self) -> list[str]:
        return sorted(self.members - {self.me})

    def piece_sends(self) -> list[tuple[int, str]]:
        """(shard, peer) of this member's pieces not sent yet: before the deadline to each
        shard's member, after it to the reducers the included set names."""
        r = self.reduction
        if r.outcome is not None or (r.phase is Phase.REDUCING and self.me not in r.included):
            return []
        included = r.included if r.phase is Phase.REDUCING else None
        out = [s for s in r.plan.sends(self.me, included) if s not in self._sent]
        self._sent.update(out)
        return out

    def on_piece(self, piece: Piece) -> bool:
        """Another member's piece (its header taken with the first); refusals counted."""
        r = self.reduction
        author = piece.header.author
        if author not in r.contributors:
            if not r.contribute(piece.header, piece.proof):
                return False
        elif r.header_of(author) != piece.header:
            return r.count("headers_differ")
        elif not r.take_proof(author, piece.proof):
            return False
        return r.take_piece(author, piece.shard, piece.tensor)

    def on_shard(self, signer: str, shard: ReducedShard | WireShard) -> bool:
        """A reduced shard from `signer`, held until this member reduces its included set."""
        if signer not in self.members or shard.round_id != self.round_id:
            return self.reduction.count("shard_not_for_this_round")
        if isinstance(shard, WireShard):
            try:
                shard = shard.over(self.reduction.plan.members)
            except ProofError:
                return self.reduction.count("bad_included")
        return self.reduction.take_reduced(
            shard.shard, shard.tensor, shard.signature, shard.included, shard.digest
        )

    def holds(self, shard: ReducedShard | WireShard) -> bool:
        """Whether this member holds `shard`'s values for the attempt it names (what a
        replica holder answers on `group-held`)."""
        if isinstance(shard, WireShard):
            try:
                shard = shard.over(self.reduction.plan.members)
            except ProofError:
                return False
        return shard.round_id == self.round_id and self.reduction.holds_values(
            shard.shard, shard.included
        )

    def tick(self, now: float, alive: Callable[[str], bool] = lambda _: True) -> list[ReducedShard]:
        """The deadline (or every member in): close; then this member's shards whose pieces
        are all in, reduced and co-signed, to share (folded: in here once `replica_took`);
        past the co-sign deadline: abandon, or wait one more window for one reducer `alive`
        says is alive (CosignClock)."""
        r = self.reduction
        if r.phase is Phase.COLLECTING and (now >= self.deadline or r.contributors == self.members):
            r.close()
        out = []
        if r.phase is Phase.REDUCING:
            for shard in r.shards_of(self.me):
                if (r.included, shard) in self._shared or not r.ready(shard):
                    continue
                tensor = r.reduce(shard)
                digest = shard_digest(tensor, r.numel, r.bounds[shard][0])
                signature = self._identity.sign(r.statement(shard, tensor))
                self._shared.add((r.included, shard))
                out.append(
                    ReducedShard(
                        r.group_key,
                        r.epoch,
                        r.round,
                        r.included,
                        shard,
                        signature,
                        tensor,
                        r.plan.members,
                        digest,
                    )
                )
                if r.fold and self.replica_holder(shard) is not None:
                    self._unheld[(r.included, shard)] = out[-1]  # in once its holder has it
                    r.remember(shard, digest, tensor)
                    continue
                r.take_reduced(shard, tensor, signature)
                if r.phase is not Phase.REDUCING:
                    break

        # this member is alive whatever its view says (a node's view holds its peers only):
        # folded, its own shard is missing here until its replica holder has it
        def live(peer: str) -> bool:
            return peer == self.me or alive(peer)

        if r.phase is Phase.REDUCING:
            self._lose_by_view(now, live)
        if r.phase is Phase.REDUCING and self.clock.expired(now, r.missing_reducers(), live):
            r.expire()
        return out

    def _lose_by_view(self, now: float, alive: Callable[[str], bool]) -> None:
        """Reducers with a shard missing that `alive` says are gone, once the first co-sign
        deadline has passed (CosignClock.losses): the round retries without them in the one
        extra window when it can; else the clock abandons it. Before that deadline one
        member's flapping live view never retries alone (session 18)."""
        lost = self.clock.losses(now, self.reduction.missing_reducers(), alive)
        if lost and self.reduction.can_retry_without(lost):
            self.reduction.lose_all(lost)
            self.clock.retried()

    def recipients(self) -> list[str]:
        return [m for m in self.reduction.included if m != self.me]

    def replica_holder(self, shard: int) -> str | None:
        """Who holds `shard` after its reducer in a folded round: the next included member
        in sorted order (merge.shard_holders `shard_holders`' second); None when alone."""
        r = self.reduction
        included = sorted(r.included)
        if len(included) < 2 or not r.reducers:
            return None
        at = included.index(r.reducers[shard])
        return included[(at + 1) % len(included)]

    def replica_took(self, out: ReducedShard) -> bool:
        """Folded: `out`'s replica holder said it took the values; the shard is in here now
        (the round may complete) and its seal may go to the other included members. False
        when the round moved on (another attempt, or over) or `out` was not waiting."""
        r = self.reduction
        waiting = self._unheld.pop((out.included, out.shard), None)
        if waiting is None or r.phase is not Phase.REDUCING or r.included != out.included:
            return False
        assert out.tensor is not None
        return r.take_reduced(out.shard, out.tensor, out.signature)

    def missing_reducers(self) -> list[str]:
        return self.reduction.missing_reducers()

    def on_lost(self, member: str) -> bool:
        """`member` died with a shard missing: retry without it (once) or abandon."""
        before = (self.reduction.phase, self.reduction.included)
        self.reduction.lose(member)
        return (self.reduction.phase, self.reduction.included) != before

    def adopt(self, update: GroupUpdate) -> bool:
        return self.reduction.adopt(update)
