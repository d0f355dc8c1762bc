"""One member's side of a learner group's round by reduce-scatter (`--group-scatter`), and
its messages; pure (dht/group_exchange.py does the network). The decisions are
merge.group_shards' and merge.group_plan's.

- `group-piece` (`DGP4`; `DGP3` before session 27, refused as "old_version"): a member's signed
  header, its part's shard digests (the header's digest is their root; each the root of its
  shard's chunk digests: merge.group_chunks, whose grid cuts the shards), a shard index and
  that shard of its part in the swarm's codec. Sent to the shard's member before the deadline,
  to the shard's reducer after it when that is another member (a member not included, or lost).
  A receiver checks the piece against its author's signature before keeping anything
  (`decode_piece`: GroupMessageError otherwise).
- `group-shard` (`DGS2`; `DGS1` refused as "old_version"): a reduced shard, the included set it
  was reduced over and its reducer's co-signature; sent to every other included member (the
  all-gather).
- `ShardedRound` drives `ShardedReduction` for this member from events with their time, as
  dht.grouping_round.GroupRound does for whole parts: pieces in until the deadline, its own
  reduced shards out once their pieces are in, the others' in; a reducer lost with a shard
  missing makes the round retry once without it; shards not all in by the co-sign deadline
  abandon it, unless they are one live reducer's (the deadline then moves once:
  dht.grouping_patience, session 14). A reducer this member's live view says is gone is lost
  only past the first co-sign deadline (session 18: views flap under load, and one member
  retrying alone split the round). Per member and round: about one part out and one in, plus
  one update in.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from dht.grouping_patience import CosignClock, round_deadlines
from dht.grouping_wire import (
    MAX_CODEC_NAME,
    MAX_COUNT,
    MAX_HEADER_BYTES,
    MAX_MEMBERS,
    GroupMessageError,
    RoundId,
    _coded,
    _header_fields,
    _parse_header,
    names_a_round,
)
from merge.codecs import get_codec
from merge.group_chunks import aligned_bounds, shard_digest, split
from merge.group_plan import shard_root
from merge.group_shards import ShardedReduction
from merge.group_update import (
    SIGNATURE_BYTES,
    Abandoned,
    ContributionHeader,
    GroupUpdate,
    Phase,
    ReductionConfig,
)
from merge.identity import Identity

PIECE_MAGIC = b"DGP4"
SHARD_MAGIC = b"DGS2"
OLD_MAGICS = {b"DGP3": "group piece", b"DGS1": "group shard"}
"""Session 26's forms (shards cut by `torch.tensor_split`, digests SHA-256 of their values):
refused as "old_version" (session 27: the chunk grid, chunk roots)."""
_DIGEST = 64


def piece_max_bytes(numel: int) -> int:
    meta = MAX_HEADER_BYTES + MAX_MEMBERS * (_DIGEST + 3) + 64
    return len(PIECE_MAGIC) + 4 + meta + 1 + MAX_CODEC_NAME + 4 * numel


def shard_max_bytes(numel: int) -> int:
    return len(SHARD_MAGIC) + 4 + 512 + MAX_MEMBERS * 132 + 1 + MAX_CODEC_NAME + 4 * numel


def _coded_tail(tensor: torch.Tensor, codec: str) -> bytes:
    name = codec.encode()
    if not 0 < len(name) <= MAX_CODEC_NAME:
        raise ValueError(f"codec name {codec!r} is too long.")
    payload = get_codec(codec).encode(tensor.detach().to(torch.float32).contiguous())
    return bytes([len(name)]) + name + payload


def _framed(magic: bytes, meta: dict[str, object], tail: bytes) -> bytes:
    raw = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return magic + struct.pack(">I", len(raw)) + raw + tail


def _unframe(blob: object, magic: bytes, limit: int, what: str) -> tuple[object, bytes]:
    if isinstance(blob, bytes) and blob[:4] in OLD_MAGICS:
        raise GroupMessageError("old_version", f"a session 26 {OLD_MAGICS[blob[:4]]}")
    if not isinstance(blob, bytes) or len(blob) < 8 or blob[:4] != magic:
        raise GroupMessageError("malformed", f"not a {what}")
    (length,) = struct.unpack(">I", blob[4:8])
    if length > limit or len(blob) < 8 + length:
        raise GroupMessageError("malformed", f"a {what}'s header of {length} bytes")
    try:
        return json.loads(blob[8 : 8 + length]), blob[8 + length :]
    except (ValueError, RecursionError):
        raise GroupMessageError("malformed", f"a {what}'s header is not JSON") from None


def encode_piece(
    header: ContributionHeader,
    digests: tuple[str, ...],
    shard: int,
    piece: torch.Tensor,
    codec: str,
) -> bytes:
    """Shard `shard` of a member's part (`piece`: exactly what the codec decodes it to)."""
    meta = {"header": _header_fields(header), "digests": list(digests), "shard": shard}
    return _framed(PIECE_MAGIC, meta, _coded_tail(piece, codec))


@dataclass(frozen=True)
class Piece:
    header: ContributionHeader
    digests: tuple[str, ...]
    shard: int
    tensor: torch.Tensor


def decode_piece(blob: object, numel: int) -> Piece:
    """An untrusted `group-piece`: its header signed by its author, its digests the root the
    header signs, the piece of the size its shard has and the digest its author signed."""
    limit = MAX_HEADER_BYTES + MAX_MEMBERS * (_DIGEST + 3) + 64
    meta, tail = _unframe(blob, PIECE_MAGIC, limit, "group piece")
    if not isinstance(meta, dict) or set(meta) != {"header", "digests", "shard"}:
        raise GroupMessageError("malformed", "a group piece with the wrong fields")
    digests, shard = meta["digests"], meta["shard"]
    if (
        not isinstance(digests, list)
        or not 0 < len(digests) <= MAX_MEMBERS
        or not all(isinstance(d, str) and len(d) == _DIGEST for d in digests)
        or type(shard) is not int
        or not 0 <= shard < len(digests)
    ):
        raise GroupMessageError("malformed", "a group piece's digests or shard out of range")
    header = _parse_header(meta["header"])
    start, end = aligned_bounds(numel, len(digests))[shard]
    tensor = _coded(tail, end - start)
    if shard_root(digests) != header.digest or shard_digest(tensor, numel, start) != digests[shard]:
        raise GroupMessageError("bad_signature", "a group piece its author did not sign")
    if not header.verified():
        raise GroupMessageError("bad_signature", "a group piece its author did not sign")
    return Piece(header, tuple(digests), shard, tensor)


@dataclass(frozen=True)
class ReducedShard:
    """A reducer's shard of one group round, for one included set, with its co-signature."""

    group_key: str
    epoch: int
    round: int
    included: tuple[str, ...]
    shard: int
    signature: bytes
    tensor: torch.Tensor

    @property
    def round_id(self) -> RoundId:
        return (self.group_key, self.epoch, self.round)

    def to_bytes(self, codec: str) -> bytes:
        meta = {
            "group_key": self.group_key,
            "epoch": self.epoch,
            "round": self.round,
            "included": list(self.included),
            "shard": self.shard,
            "signature": self.signature.hex(),
        }
        return _framed(SHARD_MAGIC, meta, _coded_tail(self.tensor, codec))


def decode_shard(blob: object, numel: int) -> ReducedShard:
    """An untrusted `group-shard`'s fields and tensor (its size is checked by the round it is
    for, against its member list's split; its co-signature against the shard's reducer)."""
    meta, tail = _unframe(blob, SHARD_MAGIC, 512 + MAX_MEMBERS * 132, "group shard")
    try:
        assert isinstance(meta, dict)
        included = meta["included"]
        fields = (meta["group_key"], meta["epoch"], meta["round"], meta["shard"])
        signature = bytes.fromhex(meta["signature"])
    except (AssertionError, KeyError, TypeError, ValueError, AttributeError):
        raise GroupMessageError("malformed", "a group shard that does not parse") from None
    group_key, epoch, round_, shard = fields
    ok = (
        names_a_round(group_key, included)
        and all(type(v) is int and 0 <= v <= MAX_COUNT for v in (epoch, round_, shard))
        and len(signature) == SIGNATURE_BYTES
    )
    if not ok or len(tail) > 1 + MAX_CODEC_NAME + 4 * numel:
        raise GroupMessageError("malformed", "a group shard with fields out of range")
    if not tail or not 0 < tail[0] <= MAX_CODEC_NAME or len(tail) < 1 + tail[0]:
        raise GroupMessageError("malformed", "a group shard without a codec name")
    per_value = get_codec_bytes(tail[1 : 1 + tail[0]])
    tensor = _coded(tail, (len(tail) - 1 - tail[0]) // per_value)
    return ReducedShard(group_key, epoch, round_, tuple(included), shard, signature, tensor)


def get_codec_bytes(name: bytes) -> int:
    """Bytes per value of a dense codec a reduced shard may travel in (fp32 or bf16)."""
    sizes = {b"fp32": 4, b"bf16": 2}
    if name not in sizes:
        raise GroupMessageError("malformed", "a group shard in a codec other than fp32 or bf16")
    return sizes[name]


def shard_codec(tensor: torch.Tensor) -> str:
    """bf16 when every value of the reduced shard is one (parts in bf16: exact), else fp32."""
    return "bf16" if torch.equal(tensor.to(torch.bfloat16).to(torch.float32), tensor) else "fp32"


class ShardedRound:
    """This member's side of one group round by reduce-scatter; pure: events in with their
    time, pieces and reduced shards to send out. `outcome`: a GroupUpdate or Abandoned."""

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
        )
        self.header, self.digests = header, digests
        self.pieces = split(tensor.detach().to(torch.float32), len(digests))
        self.deadline, first = round_deadlines(opened_at, wait_s, cosign_s, grace_s)
        self.clock = CosignClock(first, extension_s=cosign_s)
        self._sent: set[tuple[int, str]] = set()
        self._shared: set[tuple[tuple[str, ...], int]] = set()
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
    def outcome(self) -> GroupUpdate | Abandoned | None:
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
        if author not in r.contributors and not r.contribute(piece.header, piece.digests):
            return False
        if r.header_of(author) != piece.header:
            return r.count("headers_differ")
        return r.take_piece(author, piece.shard, piece.tensor)

    def on_shard(self, signer: str, shard: ReducedShard) -> bool:
        """A reduced shard from `signer`, held until this member reduces its included set."""
        if signer not in self.members or shard.round_id != self.round_id:
            return self.reduction.count("shard_not_for_this_round")
        return self.reduction.take_reduced(
            shard.shard, shard.tensor, shard.signature, shard.included
        )

    def tick(self, now: float, alive: Callable[[str], bool] = lambda _: True) -> list[ReducedShard]:
        """The deadline (or every member in): close; then this member's shards whose pieces
        are all in, reduced and co-signed, to share; past the co-sign deadline: abandon, or
        wait one more window for one reducer `alive` says is alive (CosignClock)."""
        r = self.reduction
        if r.phase is Phase.COLLECTING and (now >= self.deadline or r.contributors == self.members):
            r.close()
        out = []
        if r.phase is Phase.REDUCING:
            for shard in r.shards_of(self.me):
                if (r.included, shard) in self._shared or not r.ready(shard):
                    continue
                tensor = r.reduce(shard)
                signature = self._identity.sign(r.statement(shard, tensor))
                self._shared.add((r.included, shard))
                out.append(
                    ReducedShard(
                        r.group_key, r.epoch, r.round, r.included, shard, signature, tensor
                    )
                )
                r.take_reduced(shard, tensor, signature)
                if r.phase is not Phase.REDUCING:
                    break
        if r.phase is Phase.REDUCING:
            self._lose_by_view(now, alive)
        if r.phase is Phase.REDUCING and self.clock.expired(now, r.missing_reducers(), alive):
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

    def missing_reducers(self) -> list[str]:
        return self.reduction.missing_reducers()

    def on_lost(self, member: str) -> bool:
        """`member` died with a shard missing: retry without it (once) or abandon."""
        before = (self.reduction.phase, self.reduction.included)
        self.reduction.lose(member)
        return (self.reduction.phase, self.reduction.included) != before

    def adopt(self, update: GroupUpdate) -> bool:
        return self.reduction.adopt(update)
