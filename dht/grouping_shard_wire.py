"""A learner group's reduce-scatter messages (split from dht.grouping_shards, session 28):
`group-piece` (DGP5: one shard's digest and its Merkle path to the signed root) and
`group-shard` (DGS3: the co-signers as a bitmap over the round's member list), their frames'
sizes for the simulator, and the older forms refused as "old_version". See
dht.grouping_shards for who sends what when."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace

import torch

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
from merge.group_chunks import aligned_bounds, shard_digest
from merge.group_update import SIGNATURE_BYTES, ContributionHeader
from merge.shard_proof import ProofError, ShardProof, bitmap_of, members_of

PIECE_MAGIC = b"DGP5"
SHARD_MAGIC = b"DGS3"
SEAL_MAGIC = b"DGS4"
"""A reduced shard's co-signature without its values (the fold, `--group-fold`, session 29):
the `DGS3` fields and the shard's digest (the root of its chunk digests, what the co-signature
covers); sent to every included member but the shard's replica holder, who gets the `DGS3`."""
OLD_MAGICS = {
    b"DGP3": "session 26 group piece",
    b"DGS1": "session 26 group shard",
    b"DGP4": "session 27 group piece (all g digests)",
    b"DGS2": "session 27 group shard (co-signers by peer id)",
}
"""Earlier forms, refused as "old_version": session 26's (shards cut by `torch.tensor_split`,
digests SHA-256 of their values) and session 27's (a root over a flat hash of the digest list,
which every piece carried; the included set by peer id)."""
_DIGEST = 64


def piece_max_bytes(numel: int) -> int:
    meta = _piece_meta_limit()
    return len(PIECE_MAGIC) + 4 + meta + 1 + MAX_CODEC_NAME + 4 * numel


def _piece_meta_limit() -> int:
    return MAX_HEADER_BYTES + (MAX_MEMBERS.bit_length() + 1) * (_DIGEST + 3) + 128


_SHARD_META_LIMIT = 512 + MAX_MEMBERS // 4 + 8


def shard_max_bytes(numel: int) -> int:
    return len(SHARD_MAGIC) + 4 + _SHARD_META_LIMIT + 1 + MAX_CODEC_NAME + 4 * numel


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
        raise GroupMessageError("old_version", f"a {OLD_MAGICS[blob[:4]]}")
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
    """Shard `shard` of a member's part (`piece`: exactly what the codec decodes it to), with
    that shard's digest and its path to the root the header signs (`digests`: all of them)."""
    proof = ShardProof.of(digests, shard)
    meta = {
        "header": _header_fields(header),
        "shard": shard,
        "shards": proof.count,
        "digest": proof.digest,
        "path": list(proof.path),
    }
    return _framed(PIECE_MAGIC, meta, _coded_tail(piece, codec))


def piece_frame_bytes(digests: tuple[str, ...], shard: int, codec: str) -> int:
    """A `group-piece`'s bytes beyond its header's fields and its coded values, exactly as
    `encode_piece` frames them (the simulator counts these: bench.scale_sim_reduce)."""
    proof = ShardProof.of(digests, shard)
    rest = {"header": {}, "shard": shard, "shards": proof.count, "digest": proof.digest}
    meta = dict(rest, path=list(proof.path))
    raw = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return len(PIECE_MAGIC) + 4 + len(raw) - 2 + 1 + len(codec.encode())


@dataclass(frozen=True)
class Piece:
    header: ContributionHeader
    proof: ShardProof
    tensor: torch.Tensor

    @property
    def shard(self) -> int:
        return self.proof.shard


def decode_piece(blob: object, numel: int) -> Piece:
    """An untrusted `group-piece`: its header signed by its author, its shard's digest proven
    against the root the header signs, the piece of the size its shard has and that digest."""
    meta, tail = _unframe(blob, PIECE_MAGIC, _piece_meta_limit(), "group piece")
    if not isinstance(meta, dict) or set(meta) != {"header", "shard", "shards", "digest", "path"}:
        raise GroupMessageError("malformed", "a group piece with the wrong fields")
    shard, count, path = meta["shard"], meta["shards"], meta["path"]
    if (
        type(count) is not int
        or not 0 < count <= MAX_MEMBERS
        or type(shard) is not int
        or not 0 <= shard < count
        or not isinstance(path, list)
    ):
        raise GroupMessageError("malformed", "a group piece's shard or proof out of range")
    header = _parse_header(meta["header"])
    proof = ShardProof(shard, count, meta["digest"], tuple(path))
    try:
        root = proof.root()
    except ProofError:
        raise GroupMessageError("bad_proof", "a group piece whose proof does not parse") from None
    start, end = aligned_bounds(numel, count)[shard]
    tensor = _coded(tail, end - start)
    if root != header.digest or shard_digest(tensor, numel, start) != proof.digest:
        raise GroupMessageError("bad_signature", "a group piece its author did not sign")
    if not header.verified():
        raise GroupMessageError("bad_signature", "a group piece its author did not sign")
    return Piece(header, proof, tensor)


@dataclass(frozen=True)
class ReducedShard:
    """A reducer's shard of one group round, for one included set, with its co-signature;
    `members`: the round's sorted member list, which the included set's bitmap is over."""

    group_key: str
    epoch: int
    round: int
    included: tuple[str, ...]
    shard: int
    signature: bytes
    tensor: torch.Tensor | None
    """The reduced values (None: a seal, `DGS4`: the digest alone)."""
    members: tuple[str, ...]
    digest: str | None = None
    """The shard's digest, which the co-signature covers (a seal's; a `DGS3`'s is its
    values')."""

    @property
    def round_id(self) -> RoundId:
        return (self.group_key, self.epoch, self.round)

    def _meta(self) -> dict[str, object]:
        return {
            "group_key": self.group_key,
            "epoch": self.epoch,
            "round": self.round,
            "included": bitmap_of(self.included, self.members),
            "shard": self.shard,
            "signature": self.signature.hex(),
        }

    def to_bytes(self, codec: str) -> bytes:
        assert self.tensor is not None, "a seal is sent by seal_bytes"
        return _framed(SHARD_MAGIC, self._meta(), _coded_tail(self.tensor, codec))

    def seal_bytes(self, digest: str) -> bytes:
        """The co-signature without the values (`DGS4`): the shard's `digest`, no tensor."""
        return _framed(SEAL_MAGIC, {**self._meta(), "digest": digest}, b"")


def shard_frame_bytes(shard: ReducedShard, codec: str) -> int:
    """A `group-shard`'s bytes beyond its coded values, exactly as `to_bytes` frames them."""
    return len(replace(shard, tensor=torch.zeros(0)).to_bytes(codec))


@dataclass(frozen=True)
class WireShard:
    """A decoded `group-shard` whose included set is still its bitmap: the round it names
    decodes it over its member list (`over`)."""

    group_key: str
    epoch: int
    round: int
    bitmap: str
    shard: int
    signature: bytes
    tensor: torch.Tensor | None
    digest: str | None = None
    """A seal's (`DGS4`) shard digest; its tensor is None."""

    @property
    def round_id(self) -> RoundId:
        return (self.group_key, self.epoch, self.round)

    def over(self, members: tuple[str, ...]) -> ReducedShard:
        """The shard with its included set, the bitmap decoded over the round's sorted member
        list (ProofError unless it is the one bitmap of a non-empty subset of it)."""
        included = members_of(self.bitmap, members)
        return ReducedShard(
            self.group_key,
            self.epoch,
            self.round,
            included,
            self.shard,
            self.signature,
            self.tensor,
            members,
            self.digest,
        )


def decode_shard(blob: object, numel: int) -> WireShard:
    """An untrusted `group-shard`'s fields and tensor, or a seal's (`DGS4`) digest (its size is
    checked by the round it is for, against its member list's split, its bitmap decoded over
    that list, its co-signature checked against the shard's reducer)."""
    seal = isinstance(blob, bytes) and blob[:4] == SEAL_MAGIC
    magic = SEAL_MAGIC if seal else SHARD_MAGIC
    meta, tail = _unframe(blob, magic, _SHARD_META_LIMIT + _DIGEST + 16, "group shard")
    try:
        assert isinstance(meta, dict) and set(meta) == _SHARD_FIELDS | (
            {"digest"} if seal else set()
        )
        bitmap = meta["included"]
        fields = (meta["group_key"], meta["epoch"], meta["round"], meta["shard"])
        signature = bytes.fromhex(meta["signature"])
        digest = meta.get("digest")
    except (AssertionError, KeyError, TypeError, ValueError, AttributeError):
        raise GroupMessageError("malformed", "a group shard that does not parse") from None
    group_key, epoch, round_, shard = fields
    ok = (
        names_a_round(group_key, ["-"])
        and isinstance(bitmap, str)
        and 0 < len(bitmap) <= MAX_MEMBERS // 4 + 2
        and all(type(v) is int and 0 <= v <= MAX_COUNT for v in (epoch, round_, shard))
        and len(signature) == SIGNATURE_BYTES
    )
    if not ok or len(tail) > 1 + MAX_CODEC_NAME + 4 * numel:
        raise GroupMessageError("malformed", "a group shard with fields out of range")
    if seal:
        if tail or not _is_digest(digest):
            raise GroupMessageError("malformed", "a group shard's seal with a bad digest")
        assert isinstance(digest, str)
        return WireShard(group_key, epoch, round_, bitmap, shard, signature, None, digest)
    if not tail or not 0 < tail[0] <= MAX_CODEC_NAME or len(tail) < 1 + tail[0]:
        raise GroupMessageError("malformed", "a group shard without a codec name")
    per_value = get_codec_bytes(tail[1 : 1 + tail[0]])
    tensor = _coded(tail, (len(tail) - 1 - tail[0]) // per_value)
    return WireShard(group_key, epoch, round_, bitmap, shard, signature, tensor)


_SHARD_FIELDS = frozenset({"group_key", "epoch", "round", "included", "shard", "signature"})


def _is_digest(value: object) -> bool:
    return (
        isinstance(value, str)
        and len(value) == _DIGEST
        and all(c in "0123456789abcdef" for c in value)
    )


def get_codec_bytes(name: bytes) -> int:
    """Bytes per value of a dense codec a reduced shard may travel in (fp32 or bf16)."""
    sizes = {b"fp32": 4, b"bf16": 2}
    if name not in sizes:
        raise GroupMessageError("malformed", "a group shard in a codec other than fp32 or bf16")
    return sizes[name]


def shard_codec(tensor: torch.Tensor) -> str:
    """bf16 when every value of the reduced shard is one (parts in bf16: exact), else fp32."""
    return "bf16" if torch.equal(tensor.to(torch.bfloat16).to(torch.float32), tensor) else "fp32"
