"""The bodies of a fetch round's `propose` and `part` messages (dht.shard_fetch_wire frames
and signs them); pure. Session 27 (docs/scale.md, "Session 27: the fetch round's parts and
proposals in compact binary form") made them compact; a node of this release sends only the
compact forms and still reads the session 26 (JSON) forms of a proposal, told apart by their
keys; since session 29 a part is versioned and older parts are refused.

- `part`, session 29: `{"v": 3, "variants": B64}` and one tensor: the upper triangle, row
  by row, of the member's part Gram matrix in float32 values (merge.shard_part `wire_part`
  rounds it, the diagonal up and the rest toward zero, before the member uses it itself; a
  part is exactly symmetric), carried as the message's tensor (raw, covered by the
  signature like a `sums` message's), and the SHA-256 of the round's variant digests in id
  order (merge.shard_part `variants_digest`, 32 raw bytes). The receiver mirrors the
  triangle back: the same values bit for bit as the sender's own copy, so every member sums
  the same parts (`summed_gram`) and decides alike. (3 + K)(4 + K) / 2 x 4 bytes and 32
  against sessions 27-28's float64 triangle and K digests in base64 (8.0 KB at K = 31, 2.7
  KB now). Sessions 27-28 (`{"upper": B64, "digests": B64}`) and 26 (`{"gram": [[float]],
  "variants": [hex]}`) are refused as "old_version" (docs/trust.md, "A member's part in
  fp32": the checks and the decision read the values the sender signed and used).
- `propose`, session 28: `{"base": [count, digest], "holders": [peer id], "ids": [[key, seq,
  [index]]], "state_sha": B64}`: each holder named once in a table that the ids name by
  index, and the SHA-256 (32 raw bytes) of the sender's state blocks (merge.shard_states
  `states_digest`) in place of the g blocks: the blocks travel in a `states` message
  (`{"states": [blocks, B64]}`, the blocks as raw little-endian float64, all one length,
  concatenated) only between members whose digests differ (merge.shard_states
  `states_wanted`), and are taken only when they hash to the signed digest. Still read:
  session 27's compact form (`"states": [blocks, B64]` in the proposal, the blocks in full)
  and session 26's (holders inline in each id, `[key, seq, [peer id]]`, states as JSON
  floats); a node of this release sends only the session 28 form.

What a receiver does with holders: the round's holders of an id are the sorted union of
those its class's members named (merge.shard_fetch `agreed`), tried in that order for the
member's slice (`group-slice`) and, on a fallback, for the whole update. So one member need
not name every holder it knows: dht.group_exchange_fetch names at most `NAMED_HOLDERS` (2) per
id, the first it heard of (the notifiers: each peer outside a group hears of its round from
two of its members, dht.group_exchange_done `COPIES`); the union over the class, whose
members heard from other notifiers, keeps the rest. The table costs one index where two ids
share a holder (several rounds of one group, or one group's members notifying for both).

Everything signed is the body as sent (its base64 strings included): the fields a receiver
decodes are a pure function of the signed bytes. A part's triangle of the wrong length or
not finite, a digest not base64, and a proposal's states or holder indices out of bounds,
are GroupMessageErrors (their reasons counted against the sender by the caller).
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections.abc import Sequence
from typing import Any

import torch

from dht.grouping_fields import DIGEST_BYTES, fixed_pieces, raw_digest
from dht.grouping_wire import MAX_COUNT, MAX_MEMBERS, MAX_TEXT, GroupMessageError
from merge.shard_fetch import (
    MAX_CANDIDATES,
    MAX_HOLDERS,
    MAX_STATES,
    Proposal,
    StateBlock,
    UpdateId,
)
from merge.shard_part import mirrored, triangle_side, upper_triangle, variants_digest
from merge.shard_states import states_digest

NAMED_HOLDERS = 2
"""Holders one proposal names per id (see the module's docstring)."""
MAX_BASIS = MAX_STATES + MAX_CANDIDATES
"""Rows of a part Gram matrix at most: the state tensors, then the round's updates."""
MAX_TRIANGLE = MAX_BASIS * (MAX_BASIS + 1) // 2
"""Values of a part's upper triangle at most (the one tensor a `part` message carries)."""
PART_VERSION = 3
"""The `part` body's version: 3 since session 29 (float32 triangle as the message's tensor,
one digest of the variant list); sessions 26-28 had no version key (refused)."""
_BLOCK_SIZES = {k * (k + 1) // 2 for k in range(1, MAX_STATES + 1)}

# ---- part -----------------------------------------------------------------------------------


def part_message(
    part: Sequence[Sequence[float]], variants: Sequence[str]
) -> tuple[dict[str, Any], tuple[torch.Tensor, ...]]:
    """A part's session 29 body and tensors: the SHA-256 of the round's variant list
    (merge.shard_part `variants_digest`) and the upper triangle of the part as one float32
    tensor (ValueError: `part` not symmetric bit for bit or not of float32 values, or a
    variant not a lowercase SHA-256 hex digest; none happens to what `MemberRound.part`
    makes)."""
    size = len(part)
    if any(len(row) != size for row in part):
        raise ValueError("a part Gram matrix is square.")
    if any(_bits(part[i][j]) != _bits(part[j][i]) for i in range(size) for j in range(i)):
        raise ValueError("a part Gram matrix is symmetric, bit for bit.")
    upper = upper_triangle(part)
    triangle = torch.tensor(upper, dtype=torch.float32)
    if triangle.to(torch.float64).tolist() != upper:
        raise ValueError("a part is sent in float32 values (merge.shard_part wire_part).")
    if any(raw_digest(v) is None for v in variants):
        raise ValueError("a variant digest is 64 lowercase hex digits.")
    digest = bytes.fromhex(variants_digest(variants))
    return {"v": PART_VERSION, "variants": _b64(digest)}, (triangle,)


def part_of_message(body: dict[str, Any], tensors: Sequence[torch.Tensor]) -> tuple[object, str]:
    """A `part` message's Gram matrix (its shape and checks: merge.shard_round
    `part_problem`) and the SHA-256 (hex) of its sender's variant list. Sessions 26-28's
    forms (the matrix in the JSON body, float64) are "old_version"."""
    if "gram" in body or "upper" in body:
        raise GroupMessageError("old_version", "a part of sessions 26-28 (float64 in JSON)")
    if body.get("v") != PART_VERSION or len(tensors) != 1:
        raise GroupMessageError("malformed", "a part's version or triangle")
    try:
        (digest,) = fixed_pieces(body.get("variants"), DIGEST_BYTES, 1)
    except ValueError:
        raise GroupMessageError("malformed", "a part's variants digest") from None
    upper = tensors[0].to(torch.float64).tolist()
    size = triangle_side(len(upper))
    if size is None or size > MAX_BASIS:
        raise GroupMessageError("wrong_size", "a part's triangle is no upper triangle")
    return mirrored(upper, size), digest.hex()


# ---- propose --------------------------------------------------------------------------------


def proposal_body(proposal: Proposal) -> dict[str, Any]:
    """A proposal's session 28 body: its fields, its state blocks by their digest
    (ValueError: state blocks of two lengths, which `state_blocks` never makes)."""
    table: dict[str, int] = {}
    ids = []
    for (key, seq), holders in proposal.candidates.items():
        ids.append([key, seq, [table.setdefault(h, len(table)) for h in holders]])
    if len({len(block) for block in proposal.states}) > 1:
        raise ValueError("a proposal's state blocks are all one length.")
    base = list(proposal.base)
    digest = bytes.fromhex(states_digest(proposal.states))
    return {"base": base, "holders": list(table), "ids": ids, "state_sha": _b64(digest)}


def states_body(states: Sequence[StateBlock]) -> dict[str, Any]:
    """A `states` message's body: the blocks in full (ValueError: blocks of two lengths)."""
    if len({len(block) for block in states}) > 1:
        raise ValueError("a proposal's state blocks are all one length.")
    return {"states": [len(states), _b64(_f64([x for block in states for x in block]))]}


def states_of_body(body: dict[str, Any]) -> tuple[StateBlock, ...]:
    """A `states` message's blocks, within bounds (GroupMessageError otherwise)."""
    return _compact_states(body.get("states"))


def proposal_of_body(body: dict[str, Any]) -> Proposal:
    """A `propose` body's proposal, either form, within bounds (GroupMessageError otherwise)."""
    try:
        (count, digest), ids = body["base"], body["ids"]
    except (KeyError, TypeError, ValueError):
        raise GroupMessageError("malformed", "a proposal's fields") from None
    if type(count) is not int or not 0 <= count <= MAX_COUNT or not _text(digest):
        raise GroupMessageError("malformed", "a proposal's base")
    if not isinstance(ids, list) or len(ids) > MAX_CANDIDATES:
        raise GroupMessageError("too_many_candidates", "a proposal naming too many ids")
    if "holders" in body:
        table = _holder_table(body["holders"])
        candidates = dict(_candidate(entry, table) for entry in ids)
        if "state_sha" in body:  # session 28: the blocks by their digest
            try:
                (sha,) = fixed_pieces(body["state_sha"], DIGEST_BYTES, 1)
            except ValueError:
                raise GroupMessageError("malformed", "a proposal's state digest") from None
            return Proposal((count, digest), candidates, (), sha.hex())
        return Proposal((count, digest), candidates, _compact_states(body.get("states")))
    candidates = dict(_candidate(entry, None) for entry in ids)  # session 26
    return Proposal((count, digest), candidates, _json_states(body.get("states", [])))


def _holder_table(table: object) -> list[str]:
    if not isinstance(table, list) or len(table) > MAX_CANDIDATES * MAX_HOLDERS:
        raise GroupMessageError("malformed", "a proposal's holders")
    if not all(_text(h) for h in table):
        raise GroupMessageError("malformed", "a proposal's holders")
    return table


def _candidate(entry: object, table: list[str] | None) -> tuple[UpdateId, tuple[str, ...]]:
    """One id and its holders: named (session 26, `table` None) or indices into `table`."""
    if not (isinstance(entry, list) and len(entry) == 3):
        raise GroupMessageError("malformed", "a proposal's id")
    key, seq, holders = entry
    ok = _text(key) and type(seq) is int and 1 <= seq <= MAX_COUNT
    if not ok or not isinstance(holders, list) or not 0 < len(holders) <= MAX_HOLDERS:
        raise GroupMessageError("malformed", "a proposal's id or holders")
    if table is None:
        if not all(_text(h) for h in holders):
            raise GroupMessageError("malformed", "a proposal's holders")
        return (key, seq), tuple(holders)
    if not all(type(i) is int and 0 <= i < len(table) for i in holders):
        raise GroupMessageError("malformed", "a proposal's holder indices")
    return (key, seq), tuple(table[i] for i in holders)


def _compact_states(states: object) -> tuple[StateBlock, ...]:
    """[blocks, B64]: `blocks` state blocks of one length, at most one per member."""
    if not (isinstance(states, list) and len(states) == 2 and type(states[0]) is int):
        raise GroupMessageError("malformed", "a proposal's states")
    count, values = states[0], _floats(states[1], "a proposal's states")
    if not 0 <= count <= MAX_MEMBERS or (count == 0) != (not values):
        raise GroupMessageError("malformed", "a proposal's states")
    if count and (len(values) % count or len(values) // count not in _BLOCK_SIZES):
        raise GroupMessageError("wrong_size", "a proposal's state blocks")
    width = len(values) // count if count else 0
    return tuple(tuple(values[k : k + width]) for k in range(0, len(values), width or 1))


def _json_states(states: object) -> tuple[StateBlock, ...]:
    """Session 26's state blocks: at most one per member, each at most MAX_STATES' upper
    triangle of finite JSON floats (their shape checked by `Proposal.problem`)."""
    most = MAX_STATES * (MAX_STATES + 1) // 2
    if not isinstance(states, list) or len(states) > MAX_MEMBERS:
        raise GroupMessageError("malformed", "a proposal's states")
    blocks = []
    for block in states:
        if not isinstance(block, list) or not 0 < len(block) <= most:
            raise GroupMessageError("malformed", "a proposal's state block")
        if not all(type(x) is float and math.isfinite(x) for x in block):
            raise GroupMessageError("malformed", "a proposal's state block")
        blocks.append(tuple(block))
    return tuple(blocks)


# ---- raw float64 and base64 -----------------------------------------------------------------


def _f64(values: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(values)}d", *values)


def _bits(value: float) -> bytes:
    return struct.pack("<d", value)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unbase64(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise GroupMessageError("malformed", f"{what} not base64")
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise GroupMessageError("malformed", f"{what} not base64") from None


def _floats(text: object, what: str) -> list[float]:
    """Finite little-endian float64 values from base64 (GroupMessageError otherwise)."""
    raw = _unbase64(text, what)
    if len(raw) % 8:
        raise GroupMessageError("wrong_size", f"{what}: not whole float64 values")
    values = list(struct.unpack(f"<{len(raw) // 8}d", raw))
    if not all(map(math.isfinite, values)):
        raise GroupMessageError("not_finite", f"{what} holds NaN or infinity")
    return values


def _text(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_TEXT
