"""`group-slice` answered from the shards a holder has, and its fields-less form (issue 22,
must-have 2; docs/scale.md, Session 28). Pure: dht/group_exchange_slices.py does the network.

A holder of some shards of an update (merge.shard_holders `ShardHolding`: after a folded
round a reducer and the next included member; a whole holder is the holding of every shard)
answers a range its shards cover. An asker that already has the update's fields (headers,
digests, co-signatures: ~22 KB at 1000 peers) names their variant in its ask (`variant`: the
hex of merge.shard_fetch `variant_digest`); a holder of that very variant answers without
them (`DSS3`, levers27's `shards_only_framing`): the update's id and variant, its pieces
and each piece's shard chunk digests. A holder of another variant answers with its fields
(`DSS2`), so two honest variants never cost a refusal; the asker checks every piece against
the co-signed chunk roots of the fields it holds (merge.shard_fetch `slice_pieces_problem`).

Versions: the ask is session 27's (`v` 2) with an optional `variant`, which a session 27
holder ignores (it answers `DSS2`, with fields, as before); a session 27 asker never names a
variant and never gets `DSS3`. A `DSS3` answer to an ask that named no variant, or naming
another id or variant than asked, is refused ("malformed", "wrong_update", "wrong_variant").
`DSS1` (session 26) stays refused as "old_version".
"""

from __future__ import annotations

import json
import struct

import torch

from dht.grouping_wire import MAX_MEMBERS, GroupMessageError, update_meta
from dht.shard_fetch_wire import (
    MAX_META_BYTES,
    SLICE_MAGIC,
    _coded,
    _fp32s,
    _framed,
    _hex_digest,
    _no_constant,
    decode_slice,
    parse_slice_request,
    slice_meta_bytes,
    slice_request,
)
from merge.group_chunks import num_chunks
from merge.group_update import GroupUpdate
from merge.shard_fetch import SlicePieces, UpdateId, variant_digest
from merge.shard_holders import ShardHolding

BARE_SLICE_MAGIC = b"DSS3"
"""A holder's answer without the update's fields (the asker named their variant)."""
MAX_SHARDS_META = 4096
"""A fields-less answer's JSON besides its chunk digests: its id, variant and shard list."""


def slice_ask(uid: UpdateId, start: int, end: int, variant: str | None = None) -> bytes:
    """Session 27's request for [start, end) of `uid`, naming the variant of the fields the
    asker holds (`variant`) when it needs none sent."""
    if variant is None:
        return slice_request(uid, start, end)
    fields = json.loads(slice_request(uid, start, end))
    return json.dumps({**fields, "variant": variant}).encode()


def parse_slice_ask(blob: bytes, numel: int) -> tuple[UpdateId, int, int, str | None]:
    """A peer's ask (`parse_slice_request`'s checks) and the variant it holds the fields of,
    or None (a session 27 asker, or one without the fields)."""
    uid, start, end = parse_slice_request(blob, numel)
    variant = json.loads(blob, parse_constant=_no_constant).get("variant")
    if variant is not None and not _hex_digest(variant):
        raise GroupMessageError("malformed", "a slice request's variant")
    return uid, start, end, variant


def holding_answer(
    holding: ShardHolding, uid: UpdateId, start: int, end: int, variant: str | None = None
) -> bytes:
    """Exactly [start, end) of the held update (`holding.covers` it), one piece per shard
    the range meets with the shard's chunk digests: with its fields (`DSS2`, as
    dht.shard_fetch_wire `slice_answer` cuts it) unless the ask named this very variant."""
    pieces = holding.pieces(start, end)
    codec, tail = _coded(tuple(p for _, p, _ in pieces))
    listed = {
        "shards": [k for k, _, _ in pieces],
        "sizes": [p.numel() for _, p, _ in pieces],
        "digests": [list(d) for _, _, d in pieces],
        "codec": codec,
    }
    mine = variant_digest(holding.fields)
    if variant == mine:
        magic, meta = BARE_SLICE_MAGIC, {"id": [uid[0], uid[1]], "variant": mine, **listed}
    else:
        magic, meta = SLICE_MAGIC, {"update": update_meta(holding.fields), **listed}
    raw = json.dumps(meta, separators=(",", ":")).encode()
    return magic + struct.pack(">I", len(raw)) + raw + tail


def bare_meta_bytes(numel: int) -> int:
    return MAX_SHARDS_META + slice_meta_bytes(numel) - MAX_META_BYTES


def decode_slice_answer(
    blob: object, numel: int, uid: UpdateId, known: GroupUpdate | None
) -> tuple[GroupUpdate, SlicePieces]:
    """An untrusted answer to an ask for `uid`: with its fields (`decode_slice`), or without
    them when the asker holds `known` (the fields of the variant it named); the pieces are
    checked against the fields' co-signed roots by the caller (`slice_pieces_problem`)."""
    if not (isinstance(blob, bytes) and blob[:4] == BARE_SLICE_MAGIC):
        return decode_slice(blob, numel)
    if known is None:
        raise GroupMessageError("malformed", "a slice answer without fields, not asked for")
    meta, tail = _framed(blob, BARE_SLICE_MAGIC, bare_meta_bytes(numel), "slice answer")
    ident, variant = meta.get("id"), meta.get("variant")
    if ident != [uid[0], uid[1]]:
        raise GroupMessageError("wrong_update", "a slice answer for another update")
    if variant != variant_digest(known):
        raise GroupMessageError("wrong_variant", "a slice answer of another variant")
    return known, _pieces_of(meta, tail, numel)


def _pieces_of(meta: dict[str, object], tail: bytes, numel: int) -> SlicePieces:
    """A fields-less answer's pieces by shard, within the bounds `decode_slice` keeps."""
    shards, digests = meta.get("shards"), meta.get("digests")
    if not isinstance(shards, list) or not all(type(k) is int for k in shards):
        raise GroupMessageError("malformed", "a slice answer's shards")
    if not isinstance(digests, list) or len(digests) != len(shards):
        raise GroupMessageError("malformed", "a slice answer's chunk digests")
    if not all(isinstance(d, list) and all(map(_hex_digest, d)) for d in digests):
        raise GroupMessageError("malformed", "a slice answer's chunk digests")
    if sum(len(d) for d in digests) > num_chunks(numel):
        raise GroupMessageError("malformed", "a slice answer's chunk digests")
    pieces = _fp32s(tail, meta.get("sizes"), numel, MAX_MEMBERS, meta.get("codec", "fp32"))
    if len(pieces) != len(shards) or len(set(shards)) != len(shards):
        raise GroupMessageError("malformed", "a slice answer's shards")
    listed: list[tuple[tuple[str, ...], torch.Tensor]] = [
        (tuple(d), p) for d, p in zip(digests, pieces, strict=True)
    ]
    return dict(zip(shards, listed, strict=True))
