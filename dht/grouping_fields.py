"""A group update's fields on the wire: everything but its aggregate (its included members'
signed headers, shard digests, co-signatures and, with reduce-scatter, its member list), as
one JSON object. A whole update (dht.grouping_wire `encode_update`) and every `group-slice`
answer (dht.shard_fetch_wire `slice_answer`) carry it. A member fetches K updates' slices a
round, each with g headers: these fields grow as K x g ~ N per member (docs/scale.md,
"Session 27: a group update's fields in compact form").

Two forms; a node of this release sends the compact one where it can and reads both:

- compact (session 27): the fields every header of the update signs alike (`ROUND_FIELDS`:
  run id, group key, epoch, round, learners) once, in `round`; each header's own fields in
  columns (`authors`: the author's index in `members` where the update lists it, else its peer
  id; `base`, `published`, `tokens`, `norms`); the headers' digests and signatures, the shard
  digests and the co-signatures each one base64 string of their raw bytes back to back
  (`DIGEST_BYTES`, `SIGNATURE_BYTES` each). Decoding rebuilds exactly the headers their
  authors signed: a digest is the lowercase hex of its bytes, a norm the same float, a
  signature the same bytes. An update that cannot be written so (headers that differ in a
  shared field, a digest that is not the lowercase hex of 32 bytes, a signature or
  co-signature not 64 bytes, a field of another type) goes in the full form, as it was: no
  honest update is such (a replica refuses one whose headers disagree: `header_problem`), and
  the receiver refuses it for the same reason it did before.
- full (sessions 10-26, still read: old peers' answers): {"headers": [each header as an
  object, dht.grouping_header `header_fields`], "digests": [hex], "cosignatures": [hex],
  "members": [peer ids] where listed}.

What arrives is untrusted: `update_of_meta` reads at most `MAX_FIELDS_BYTES`, each list at
most `MAX_MEMBERS` long, each text `MAX_TEXT`, each count `MAX_COUNT`, each base64 string
exactly its count times its width; anything else is a GroupMessageError ("malformed", counted
by the caller), never another exception. Signatures are checked by whoever takes the update.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import torch

from dht.grouping_header import (
    HEADER_FIELDS,
    MAX_HEADER_BYTES,
    MAX_MEMBERS,
    GroupMessageError,
    header_fields,
    names_a_round,
    parse_header,
)
from merge.group_update import SIGNATURE_BYTES, ContributionHeader, GroupUpdate

ROUND_FIELDS = ("run_id", "group_key", "epoch", "round", "learners")
"""What every header of one update signs alike (merge.group_contribution `_shared`)."""
OWN_FIELDS = {"base": "base_applied", "published": "published_applied", "tokens": "tokens"}
"""Each header's own counts: the compact form's column and the header's field."""
DIGEST_BYTES = 32
"""A SHA-256 digest (a header's `digest`, a shard digest): 64 hex characters."""
MAX_FIELDS_BYTES = MAX_MEMBERS * (MAX_HEADER_BYTES + 400)
"""An update's fields' JSON may take at most this: the full form of `MAX_MEMBERS` headers at
their bound, with a digest and a co-signature each (the compact form of as many is less)."""
_COMPACT_KEYS = frozenset(
    {"round", "authors", "norms", "digests", "signatures", "shards", "cosignatures", *OWN_FIELDS}
)


def update_meta(update: GroupUpdate) -> dict[str, object]:
    """A group update's fields but its aggregate (JSON-ready): the compact form, or the full
    one for an update the compact form cannot carry exactly."""
    compact = compact_meta(update)
    return full_meta(update) if compact is None else compact


def full_meta(update: GroupUpdate) -> dict[str, object]:
    """The full form (sessions 10-26): every header as an object, hex digests and
    co-signatures and, with reduce-scatter, the member list its split is fixed by."""
    meta: dict[str, object] = {
        "headers": [header_fields(h) for h in update.contributions],
        "digests": list(update.shard_digests),
        "cosignatures": [c.hex() for c in update.cosignatures],
    }
    if update.members:  # reduce-scatter: the member list its split is fixed by
        meta["members"] = list(update.members)
    return meta


def compact_meta(update: GroupUpdate) -> dict[str, object] | None:
    """The compact form, or None where it would not decode to exactly these fields."""
    headers = update.contributions
    if not headers or not all(_compactable(h, headers[0]) for h in headers):
        return None
    shards = [raw_digest(d) for d in update.shard_digests]
    if any(d is None for d in shards) or any(
        len(c) != SIGNATURE_BYTES for c in update.cosignatures
    ):
        return None
    index = {m: i for i, m in enumerate(update.members)}
    meta: dict[str, object] = {
        "round": [getattr(headers[0], name) for name in ROUND_FIELDS],
        "authors": [index.get(h.author, h.author) for h in headers],
        **{column: [getattr(h, name) for h in headers] for column, name in OWN_FIELDS.items()},
        "norms": [h.norm for h in headers],
        "digests": _b64(raw_digest(h.digest) for h in headers),
        "signatures": _b64(h.signature for h in headers),
        "shards": _b64(shards),
        "cosignatures": _b64(update.cosignatures),
    }
    if update.members:
        meta["members"] = list(update.members)
    return meta


def _compactable(header: ContributionHeader, first: ContributionHeader) -> bool:
    """Whether the compact form rebuilds `header` exactly beside `first`'s shared fields."""
    kinds = ((name, kind) for name, kind in HEADER_FIELDS.items() if name != "signature")
    return (
        all(type(getattr(header, name)) is kind for name, kind in kinds)
        and all(getattr(header, name) == getattr(first, name) for name in ROUND_FIELDS)
        and len(header.signature) == SIGNATURE_BYTES
        and raw_digest(header.digest) is not None
    )


def raw_digest(digest: object) -> bytes | None:
    """The 32 bytes a digest is the lowercase hex of, or None."""
    if not isinstance(digest, str) or len(digest) != 2 * DIGEST_BYTES:
        return None
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        return None
    return raw if raw.hex() == digest else None


def _b64(pieces: Any) -> str:
    return base64.b64encode(b"".join(pieces)).decode("ascii")


def update_of_meta(raw: bytes, aggregate: torch.Tensor) -> GroupUpdate:
    """An untrusted group update from its JSON fields (`update_meta`, either form) and an
    aggregate (empty when only some shards are at hand: dht.shard_fetch_wire);
    GroupMessageError when they do not parse. Its signatures are checked by whoever takes it."""
    if len(raw) > MAX_FIELDS_BYTES:
        raise GroupMessageError("malformed", f"a group update's fields of {len(raw)} bytes")
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict):
            raise TypeError("an object expected")
        if "headers" in meta:
            return _of_full(meta, aggregate)
        return _of_compact(meta, aggregate)
    except GroupMessageError:
        raise
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise GroupMessageError("malformed", "a group update that does not parse") from None


def _of_full(meta: dict[str, Any], aggregate: torch.Tensor) -> GroupUpdate:
    heads, digests, cosigns = meta["headers"], meta["digests"], meta["cosignatures"]
    if not all(isinstance(x, list) for x in (heads, digests, cosigns)):
        raise TypeError("lists expected")
    if not 0 < len(heads) <= MAX_MEMBERS:
        raise ValueError("members out of range")
    headers = tuple(parse_header(h) for h in heads)
    shard_digests = tuple(d if isinstance(d, str) else "" for d in digests)
    cosignatures = tuple(bytes.fromhex(c) for c in cosigns)
    return GroupUpdate(headers, shard_digests, cosignatures, aggregate, _members(meta))


def _members(meta: dict[str, Any]) -> tuple[str, ...]:
    members = meta.get("members", [])
    if not isinstance(members, list) or not names_a_round("x", members or ["x"]):
        raise ValueError("members out of range")
    return tuple(members)


def _of_compact(meta: dict[str, Any], aggregate: torch.Tensor) -> GroupUpdate:
    if not _COMPACT_KEYS <= set(meta) <= _COMPACT_KEYS | {"members"}:
        raise ValueError("not a group update's fields")
    members, shared, authors = _members(meta), meta["round"], meta["authors"]
    if not isinstance(shared, list) or len(shared) != len(ROUND_FIELDS):
        raise ValueError("a group update's round")
    if not isinstance(authors, list) or not 0 < len(authors) <= MAX_MEMBERS:
        raise ValueError("authors out of range")
    columns = [meta[column] for column in (*OWN_FIELDS, "norms")]
    if not all(isinstance(c, list) and len(c) == len(authors) for c in columns):
        raise ValueError("a column of another length")
    digests = fixed_pieces(meta["digests"], DIGEST_BYTES, len(authors))
    signatures = fixed_pieces(meta["signatures"], SIGNATURE_BYTES, len(authors))
    headers = tuple(
        parse_header(
            dict(zip(ROUND_FIELDS, shared, strict=True))
            | dict(zip(OWN_FIELDS.values(), own[:3], strict=True))
            | {"author": _author(author, members), "norm": own[3]}
            | {"digest": digest.hex(), "signature": signature.hex()}
        )
        for author, *own, digest, signature in zip(
            authors, *columns, digests, signatures, strict=True
        )
    )
    shards = tuple(d.hex() for d in fixed_pieces(meta["shards"], DIGEST_BYTES, None))
    cosignatures = tuple(fixed_pieces(meta["cosignatures"], SIGNATURE_BYTES, None))
    return GroupUpdate(headers, shards, cosignatures, aggregate, members)


def _author(author: object, members: tuple[str, ...]) -> object:
    """A header's author: its index in the member list, or its peer id (checked as a field)."""
    if type(author) is int:
        if not 0 <= author < len(members):
            raise ValueError("an author index out of range")
        return members[author]
    return author


def fixed_pieces(text: object, width: int, count: int | None) -> list[bytes]:
    """`count` (any up to MAX_MEMBERS: None) pieces of `width` bytes from their base64."""
    limit = 4 * (width * MAX_MEMBERS + 2) // 3 + 4
    if not isinstance(text, str) or len(text) > limit:
        raise ValueError("not base64 of its bound")
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error:
        raise ValueError("not base64") from None
    num = len(raw) // width
    if len(raw) % width or num > MAX_MEMBERS or (count is not None and num != count):
        raise ValueError("pieces of a wrong length")
    return [raw[i * width : (i + 1) * width] for i in range(num)]
