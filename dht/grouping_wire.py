"""The wire forms of a learner group round's messages that carry tensors (dht.grouping_round:
the round and its co-signatures; dht.grouping_done: the group-done notice;
dht/group_exchange.py does the network):

- `group-part`: a member's signed `ContributionHeader` and its pseudo-gradient in the swarm's
  codec (`DGP2`: what the member signed is the decoded tensor, the codec's rounding kept in
  its error feedback, node.group_publishing; `DGP1`, fp32, is still read), sent to every
  other member of its group. What arrives is untrusted: `decode_part` refuses anything
  malformed, over the size the replica allows, or not signed by its author (a
  `GroupMessageError` with the reason the caller counts), never raising anything else.
- `group-update`: a complete group update (its fields: its included members' signed
  headers, shard digests, co-signatures and member list, in dht.grouping_fields' compact form
  since session 27; then the aggregate), read the same way (`decode_update`); its signatures
  are checked by whoever takes it, as every replica does.

Versions of `group-update` (session 28). Since session 27 a shard digest is the root of its
chunks' digests on the chunk grid (merge.group_chunks), where session 26 hashed the shard's
values: a session 26 update has the same magic and fails every check as `shard_mismatch`,
counted against an honest old peer as if hostile. So:

- sent: `DGU3` (fp32 aggregate) or `DGU4` (bf16 aggregate), fields in either form;
- read: those, and session 27's `DGU1` / `DGU2` whose fields are in the compact form (only
  session 27 wrote it, and its shard digests are chunk roots: the same meaning);
- refused as "old_version" (counted `group_update_old_version`, never parsed further):
  `DGU1` / `DGU2` whose fields are in the full form (`headers`): what session 26 and every
  release before it sent. A session 27 node sends the full form only for an update its
  replicas refuse anyway (dht.grouping_fields), so no honest session 27 update is refused.

The bounds every group message is read within, the error and a header's JSON are in
dht.grouping_header; both are re-exported here.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np
import torch

from dht.grouping_fields import (
    MAX_FIELDS_BYTES,
    compact_meta,
    full_meta,
    update_meta,
    update_of_meta,
)
from dht.grouping_header import (
    HEADER_FIELDS,
    MAX_COUNT,
    MAX_HEADER_BYTES,
    MAX_MEMBERS,
    MAX_TEXT,
    GroupMessageError,
    RoundId,
    header_fields,
    in_range,
    names_a_round,
    parse_header,
)
from merge.codec_base import CodecError
from merge.codecs import get_codec
from merge.group_update import ContributionHeader, GroupUpdate, tensor_digest

__all__ = [
    "BF16_UPDATE_MAGIC",
    "CODED_PART_MAGIC",
    "HEADER_FIELDS",
    "MAX_CODEC_NAME",
    "MAX_COUNT",
    "MAX_FIELDS_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_MEMBERS",
    "MAX_TEXT",
    "PART_MAGIC",
    "UPDATE_MAGIC",
    "GroupMessageError",
    "S27_BF16_UPDATE_MAGIC",
    "S27_UPDATE_MAGIC",
    "RoundId",
    "coded",
    "compact_meta",
    "decode_part",
    "decode_update",
    "encode_part",
    "encode_update",
    "full_meta",
    "header_fields",
    "in_range",
    "names_a_round",
    "parse_header",
    "part_max_bytes",
    "update_max_bytes",
    "update_meta",
    "update_of_meta",
]
"""The bounds, the error and a header's JSON live in dht.grouping_header, an update's fields in
dht.grouping_fields (session 27); callers import them here as before."""
_header_fields, _parse_header = header_fields, parse_header
"""dht.grouping_shards' names for them (before session 27)."""

PART_MAGIC = b"DGP1"
CODED_PART_MAGIC = b"DGP2"
UPDATE_MAGIC = b"DGU3"
BF16_UPDATE_MAGIC = b"DGU4"
"""A group update whose aggregate holds bf16 values (parts in bf16), sent in bf16."""
S27_UPDATE_MAGIC = b"DGU1"
S27_BF16_UPDATE_MAGIC = b"DGU2"
"""Sessions 10-27's magics: read when the fields are compact (session 27), else "old_version"."""
_BF16_MAGICS = (BF16_UPDATE_MAGIC, S27_BF16_UPDATE_MAGIC)
_UPDATE_MAGICS = (UPDATE_MAGIC, S27_UPDATE_MAGIC, *_BF16_MAGICS)


def part_max_bytes(numel: int) -> int:
    """The largest `group-part` blob a receiver reads for a replica of `numel` parameters."""
    return len(PART_MAGIC) + 4 + MAX_HEADER_BYTES + 1 + MAX_CODEC_NAME + 4 * numel


MAX_CODEC_NAME = 16


def encode_part(
    header: ContributionHeader,
    tensor: torch.Tensor,
    codec: str = "fp32",
    payload: bytes | None = None,
) -> bytes:
    """A member's part: its signed header, then `tensor` in `codec` (`payload`: its encoding,
    when at hand, `coded`'s). The header must sign the tensor the receivers decode: a lossy
    codec's rounding is the sender's to keep (`coded`)."""
    raw = json.dumps(header_fields(header), sort_keys=True, separators=(",", ":")).encode()
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
    header = parse_header(fields)
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


def encode_update(update: GroupUpdate) -> bytes:
    """A complete group update on the wire: its fields (dht.grouping_fields `update_meta`:
    headers, shard digests, co-signatures, member list; compact since session 27), then the
    aggregate (bf16 where its values all are, else fp32)."""
    raw = json.dumps(update_meta(update), separators=(",", ":")).encode()
    head = struct.pack(">I", len(raw)) + raw
    aggregate = update.aggregate.detach().to(torch.float32).contiguous()
    narrow = aggregate.to(torch.bfloat16)
    if torch.equal(narrow.to(torch.float32), aggregate):  # bf16 values: half the bytes, exact
        return BF16_UPDATE_MAGIC + head + get_codec("bf16").encode(aggregate)
    return UPDATE_MAGIC + head + aggregate.numpy().astype("<f4").tobytes()


def update_max_bytes(numel: int) -> int:
    return len(UPDATE_MAGIC) + 4 + MAX_FIELDS_BYTES + 4 * numel


def decode_update(blob: object, numel: int) -> GroupUpdate:
    """An untrusted group update's fields; its signatures, co-signatures and shards are
    checked by whoever takes it (GroupUpdate.problem), as every replica does. A form of
    session 26 or older is GroupMessageError("old_version") (see the module's docstring)."""
    if not isinstance(blob, bytes) or len(blob) < 8 or blob[:4] not in _UPDATE_MAGICS:
        raise GroupMessageError("malformed", "not a group update")
    (length,) = struct.unpack(">I", blob[4:8])
    if len(blob) < 8 + length:
        raise GroupMessageError("malformed", "a group update cut short")
    raw = blob[8 : 8 + length]
    if blob[:4] in (S27_UPDATE_MAGIC, S27_BF16_UPDATE_MAGIC) and not _compact(raw):
        raise GroupMessageError("old_version", "a group update of session 26 or older")
    update = update_of_meta(raw, torch.empty(0))  # the fields first
    body = blob[8 + length :]
    aggregate = _bf16(body, numel) if blob[:4] in _BF16_MAGICS else _fp32(body, numel)
    return dataclasses.replace(update, aggregate=aggregate)


def _compact(raw: bytes) -> bool:
    """Whether an update's fields are in the compact form (a JSON object without `headers`,
    the full form's key); "malformed" for what is not a JSON object within the bound."""
    if len(raw) > MAX_FIELDS_BYTES:
        raise GroupMessageError("malformed", f"an update's fields of {len(raw)} bytes")
    try:
        fields = json.loads(raw)
    except (ValueError, RecursionError):
        raise GroupMessageError("malformed", "an update's fields are not JSON") from None
    if not isinstance(fields, dict):
        raise GroupMessageError("malformed", "an update's fields are not a JSON object")
    return "headers" not in fields


def _bf16(body: bytes, numel: int) -> torch.Tensor:
    try:
        tensor = get_codec("bf16").decode(body, numel)
    except CodecError:
        raise GroupMessageError("wrong_size", f"{len(body)} bytes, expected {2 * numel}") from None
    if not bool(torch.isfinite(tensor).all()):
        raise GroupMessageError("not_finite", "a group message holds NaN or infinity")
    return tensor
