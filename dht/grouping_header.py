"""The bounds every group message is read within, the error a refused one raises, and one
signed `ContributionHeader` as a JSON object (what a `group-part` and a shard piece carry,
dht.grouping_wire and dht.grouping_shards; a group update's fields: dht.grouping_fields).
Moved out of dht/grouping_wire.py unchanged (session 27); dht.grouping_wire re-exports every
name here, so callers import them there as before.
"""

from __future__ import annotations

import math
from typing import Any

from merge.group_update import SIGNATURE_BYTES, ContributionHeader

MAX_HEADER_BYTES = 4096
"""A contribution header's JSON (~550 B honest) may take at most this."""
MAX_MEMBERS = 1024
"""Members one co-signature's included set may name (a group of 1000 swarms is ~32)."""
MAX_COUNT = 2**53
MAX_TEXT = 128
HEADER_FIELDS = {
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
"""A header's JSON fields and their types (`signature`: hex)."""
RoundId = tuple[str, int, int]
"""(group key, epoch, round): one group round, the id its group update is applied under."""


class GroupMessageError(ValueError):
    """A group message refused before anything of it is kept; `reason` is what is counted."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def header_fields(header: ContributionHeader) -> dict[str, object]:
    """A header as a JSON-ready object: every field, the signature in hex."""
    fields = {name: getattr(header, name) for name in HEADER_FIELDS if name != "signature"}
    fields["signature"] = header.signature.hex()
    return fields


def in_range(value: Any) -> bool:
    """A header field's value within the bounds a receiver reads (text, count, norm)."""
    if isinstance(value, str):
        return 0 < len(value) <= MAX_TEXT
    if isinstance(value, int):
        return 0 <= value <= MAX_COUNT
    return math.isfinite(value) and 0 <= value <= 1e30


def parse_header(fields: object) -> ContributionHeader:
    """An untrusted header from its JSON object (`header_fields`); GroupMessageError when a
    field is missing, extra, of a wrong type or out of range. Its signature is not checked."""
    if not isinstance(fields, dict) or set(fields) != set(HEADER_FIELDS):
        raise GroupMessageError("malformed", "a group part's header has the wrong fields")
    for name, kind in HEADER_FIELDS.items():
        value: Any = fields[name]
        if kind is float and type(value) is int:
            value = fields[name] = float(value)
        if type(value) is not kind:
            raise GroupMessageError("malformed", f"{name} is not a {kind.__name__}")
        if not in_range(value):
            raise GroupMessageError("malformed", f"{name} out of range")
    try:
        signature = bytes.fromhex(fields.pop("signature"))
    except ValueError:
        raise GroupMessageError("malformed", "signature is not hex") from None
    if len(signature) != SIGNATURE_BYTES:
        raise GroupMessageError("malformed", "signature of a wrong length")
    return ContributionHeader(**fields, signature=signature)


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
