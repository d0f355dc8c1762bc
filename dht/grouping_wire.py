"""The wire forms of a learner group round's messages that carry tensors, and the bounds every
group message is read within (dht.grouping_round: the round and its co-signatures;
dht.grouping_done: the group-done notice; dht/group_exchange.py does the network):

- `group-part`: a member's signed `ContributionHeader` and its pseudo-gradient in the swarm's
  codec (`DGP2`: what the member signed is the decoded tensor, the codec's rounding kept in
  its error feedback, node.group_publishing; `DGP1`, fp32, is still read), sent to every
  other member of its group. What arrives is untrusted: `decode_part` refuses anything
  malformed, over the size the replica allows, or not signed by its author (a
  `GroupMessageError` with the reason the caller counts), never raising anything else.
- `group-update`: a complete group update (its included members' signed headers, shard
  digests and co-signatures, then the aggregate), read the same way (`decode_update`); its
  signatures are checked by whoever takes it, as every replica does.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from typing import Any

import numpy as np
import torch

from merge.codec_base import CodecError
from merge.codecs import get_codec
from merge.group_update import (
    SIGNATURE_BYTES,
    ContributionHeader,
    GroupUpdate,
    tensor_digest,
)

PART_MAGIC = b"DGP1"
CODED_PART_MAGIC = b"DGP2"
UPDATE_MAGIC = b"DGU1"
BF16_UPDATE_MAGIC = b"DGU2"
"""A group update whose aggregate holds bf16 values (parts in bf16), sent in bf16."""
MAX_HEADER_BYTES = 4096
"""A contribution header's JSON (~550 B honest) may take at most this."""
MAX_MEMBERS = 1024
"""Members one co-signature's included set may name (a group of 1000 swarms is ~32)."""
MAX_COUNT = 2**53
MAX_TEXT = 128
_HEADER_FIELDS = {
    "run_id": str,
    "author": str,
    "group_key": str,
    "epoch": int,
    "round": int,
    "learners": int,
    "base_applied": int,
    "published_applied": int,
    "tokens": int,
    "norm": float,
    "digest": str,
    "signature": str,
}
RoundId = tuple[str, int, int]
"""(group key, epoch, round): one group round, the id its group update is applied under."""


class GroupMessageError(ValueError):
    """A group message refused before anything of it is kept; `reason` is what is counted."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def part_max_bytes(numel: int) -> int:
    """The largest `group-part` blob a receiver reads for a replica of `numel` parameters."""
    return len(PART_MAGIC) + 4 + MAX_HEADER_BYTES + 1 + MAX_CODEC_NAME + 4 * numel


MAX_CODEC_NAME = 16


def _header_fields(header: ContributionHeader) -> dict[str, object]:
    fields = {name: getattr(header, name) for name in _HEADER_FIELDS if name != "signature"}
    fields["signature"] = header.signature.hex()
    return fields


def encode_part(
    header: ContributionHeader,
    tensor: torch.Tensor,
    codec: str = "fp32",
    payload: bytes | None = None,
) -> bytes:
    """A member's part: its signed header, then `tensor` in `codec` (`payload`: its encoding,
    when at hand, `coded`'s). The header must sign the tensor the receivers decode: a lossy
    codec's rounding is the sender's to keep (`coded`)."""
    raw = json.dumps(_header_fields(header), sort_keys=True, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"a contribution header of {len(raw)} bytes is over {MAX_HEADER_BYTES}.")
    head = struct.pack(">I", len(raw)) + raw
    if codec == "fp32":
        flat = tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
        return PART_MAGIC + head + flat.tobytes()
    name = codec.encode()
    if not 0 < len(name) <= MAX_CODEC_NAME:
        raise ValueError(f"codec name {codec!r} is too long.")
    if payload is None:
        payload = get_codec(codec).encode(tensor.detach().to(torch.float32).contiguous())
    return CODED_PART_MAGIC + head + bytes([len(name)]) + name + payload


def coded(tensor: torch.Tensor, codec: str) -> tuple[torch.Tensor, bytes]:
    """What receivers will decode of `tensor` sent in `codec`, and the payload: the member
    signs the former and keeps `tensor` minus it in its error feedback. CodecError for a
    tensor the codec cannot encode (not finite)."""
    c = get_codec(codec)
    payload = c.encode(tensor.detach().to(torch.float32).contiguous())
    return c.decode(payload, tensor.numel()), payload


def decode_part(blob: object, numel: int) -> tuple[ContributionHeader, torch.Tensor]:
    """The header and pseudo-gradient of an untrusted `group-part` blob (fp32 or coded), its
    author's signature and the decoded tensor's digest checked; GroupMessageError otherwise."""
    if (
        not isinstance(blob, bytes)
        or len(blob) < 8
        or blob[:4] not in (PART_MAGIC, CODED_PART_MAGIC)
    ):
        raise GroupMessageError("malformed", "not a group part")
    (length,) = struct.unpack(">I", blob[4:8])
    if length > MAX_HEADER_BYTES or len(blob) < 8 + length:
        raise GroupMessageError("malformed", f"a group part's header of {length} bytes")
    try:
        fields = json.loads(blob[8 : 8 + length])
    except (ValueError, RecursionError):
        raise GroupMessageError("malformed", "a group part's header is not JSON") from None
    header = _parse_header(fields)
    body = blob[8 + length :]
    tensor = _fp32(body, numel) if blob[:4] == PART_MAGIC else _coded(body, numel)
    if tensor_digest(tensor) != header.digest or not header.verified():
        raise GroupMessageError("bad_signature", "a group part its author did not sign")
    return header, tensor


def _coded(body: bytes, numel: int) -> torch.Tensor:
    """A coded part's tensor: a codec name the swarm knows, its payload of the exact size."""
    if not body or not 0 < body[0] <= MAX_CODEC_NAME or len(body) < 1 + body[0]:
        raise GroupMessageError("malformed", "a coded part without a codec name")
    try:
        codec = get_codec(body[1 : 1 + body[0]].decode("ascii"))
        tensor = codec.decode(body[1 + body[0] :], numel)
    except UnicodeDecodeError:
        raise GroupMessageError("malformed", "a codec name that is not ASCII") from None
    except CodecError as exc:
        raise GroupMessageError("wrong_size", f"a coded part that does not decode: {exc}") from None
    if tensor.shape != (numel,) or not bool(torch.isfinite(tensor).all()):
        raise GroupMessageError("not_finite", "a group message holds NaN or infinity")
    return tensor


def _fp32(body: bytes, numel: int) -> torch.Tensor:
    if len(body) != 4 * numel:
        raise GroupMessageError("wrong_size", f"{len(body)} tensor bytes, expected {4 * numel}")
    tensor = torch.from_numpy(np.frombuffer(body, dtype="<f4").astype(np.float32))
    if not bool(torch.isfinite(tensor).all()):
        raise GroupMessageError("not_finite", "a group message holds NaN or infinity")
    return tensor


def _in_range(value: Any) -> bool:
    if isinstance(value, str):
        return 0 < len(value) <= MAX_TEXT
    if isinstance(value, int):
        return 0 <= value <= MAX_COUNT
    return math.isfinite(value) and 0 <= value <= 1e30


def _parse_header(fields: object) -> ContributionHeader:
    if not isinstance(fields, dict) or set(fields) != set(_HEADER_FIELDS):
        raise GroupMessageError("malformed", "a group part's header has the wrong fields")
    for name, kind in _HEADER_FIELDS.items():
        value: Any = fields[name]
        if kind is float and type(value) is int:
            value = fields[name] = float(value)
        if type(value) is not kind:
            raise GroupMessageError("malformed", f"{name} is not a {kind.__name__}")
        if not _in_range(value):
            raise GroupMessageError("malformed", f"{name} out of range")
    try:
        signature = bytes.fromhex(fields.pop("signature"))
    except ValueError:
        raise GroupMessageError("malformed", "signature is not hex") from None
    if len(signature) != SIGNATURE_BYTES:
        raise GroupMessageError("malformed", "signature of a wrong length")
    return ContributionHeader(**fields, signature=signature)


def encode_update(update: GroupUpdate) -> bytes:
    """A complete group update on the wire: its included members' signed headers, shard
    digests and co-signatures (JSON), then the aggregate (fp32)."""
    raw = json.dumps(update_meta(update), separators=(",", ":")).encode()
    head = struct.pack(">I", len(raw)) + raw
    aggregate = update.aggregate.detach().to(torch.float32).contiguous()
    narrow = aggregate.to(torch.bfloat16)
    if torch.equal(narrow.to(torch.float32), aggregate):  # bf16 values: half the bytes, exact
        return BF16_UPDATE_MAGIC + head + get_codec("bf16").encode(aggregate)
    return UPDATE_MAGIC + head + aggregate.numpy().astype("<f4").tobytes()


def update_max_bytes(numel: int) -> int:
    return len(UPDATE_MAGIC) + 4 + MAX_MEMBERS * (MAX_HEADER_BYTES + 400) + 4 * numel


def decode_update(blob: object, numel: int) -> GroupUpdate:
    """An untrusted group update's fields; its signatures, co-signatures and shards are
    checked by whoever takes it (GroupUpdate.problem), as every replica does."""
    if (
        not isinstance(blob, bytes)
        or len(blob) < 8
        or blob[:4]
        not in (
            UPDATE_MAGIC,
            BF16_UPDATE_MAGIC,
        )
    ):
        raise GroupMessageError("malformed", "not a group update")
    (length,) = struct.unpack(">I", blob[4:8])
    if len(blob) < 8 + length:
        raise GroupMessageError("malformed", "a group update cut short")
    update = update_of_meta(blob[8 : 8 + length], torch.empty(0))  # the fields first
    body = blob[8 + length :]
    aggregate = _fp32(body, numel) if blob[:4] == UPDATE_MAGIC else _bf16(body, numel)
    return dataclasses.replace(update, aggregate=aggregate)


def update_meta(update: GroupUpdate) -> dict[str, object]:
    """A group update's fields but its aggregate (JSON-ready): headers, digests, co-signatures
    and, with reduce-scatter, the member list its split is fixed by."""
    meta: dict[str, object] = {
        "headers": [_header_fields(h) for h in update.contributions],
        "digests": list(update.shard_digests),
        "cosignatures": [c.hex() for c in update.cosignatures],
    }
    if update.members:  # reduce-scatter: the member list its split is fixed by
        meta["members"] = list(update.members)
    return meta


def update_of_meta(raw: bytes, aggregate: torch.Tensor) -> GroupUpdate:
    """An untrusted group update from its JSON fields (`update_meta`) and an aggregate (empty
    when only some shards are at hand: dht.shard_fetch_wire); GroupMessageError when they do
    not parse. Its signatures are checked by whoever takes it."""
    try:
        meta = json.loads(raw)
        heads, digests, cosigns = meta["headers"], meta["digests"], meta["cosignatures"]
        if not all(isinstance(x, list) for x in (heads, digests, cosigns)):
            raise TypeError("lists expected")
        if not 0 < len(heads) <= MAX_MEMBERS:
            raise ValueError("members out of range")
        headers = tuple(_parse_header(h) for h in heads)
        shard_digests = tuple(d if isinstance(d, str) else "" for d in digests)
        cosignatures = tuple(bytes.fromhex(c) for c in cosigns)
        members = meta.get("members", [])
        if not isinstance(members, list) or not names_a_round("x", members or ["x"]):
            raise ValueError("members out of range")
    except GroupMessageError:
        raise
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise GroupMessageError("malformed", "a group update that does not parse") from None
    return GroupUpdate(headers, shard_digests, cosignatures, aggregate, tuple(members))


def _bf16(body: bytes, numel: int) -> torch.Tensor:
    try:
        tensor = get_codec("bf16").decode(body, numel)
    except CodecError:
        raise GroupMessageError("wrong_size", f"{len(body)} bytes, expected {2 * numel}") from None
    if not bool(torch.isfinite(tensor).all()):
        raise GroupMessageError("not_finite", "a group message holds NaN or infinity")
    return tensor


def names_a_round(group_key: object, included: object) -> bool:
    """Whether an untrusted message's group key and included member list are in range (a
    co-signature and a group-done notice name their round alike)."""
    return (
        isinstance(group_key, str)
        and 0 < len(group_key) <= MAX_TEXT
        and isinstance(included, list)
        and 0 < len(included) <= MAX_MEMBERS
        and all(isinstance(m, str) and 0 < len(m) <= MAX_TEXT for m in included)
    )
