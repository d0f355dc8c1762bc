"""Strict parsers for what peers send besides heartbeats: headers, DHT records, state manifests
and seals.

Everything a peer hands this node (a notify stream, a DHT announcement, a holder or run
record, the manifest at the head of a state stream) goes through one of these functions
before anything reads it. Each checks the size first (before it allocates or decodes),
parses into a strict typed model, and raises :class:`MessageError` with a reason that the
caller counts per peer; nothing else escapes, whatever the bytes (fuzzed in
tests/unit/test_messages.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dht.ranges import to_runs
from dht.records import owner_subkey, subkey_owner
from merge.envelope import (
    MAX_HEADER_JSON_BYTES,
    SIGNATURE_BYTES,
    EnvelopeError,
    SignedHeader,
    verify_header,
)
from merge.identity import Identity, verify_signature

MAX_SIGNED_HEADER_BYTES = 8 + MAX_HEADER_JSON_BYTES + 64
MAX_SEQ = 2**53
MAX_RUN_SUMMARY_BYTES = 4096
MAX_STATE_META_BYTES = 64 << 20
MAX_STATE_TENSORS = 64
MAX_TENSOR_DIMS = 8
MAX_TENSOR_DIM = 1 << 40
REASONS = ("malformed", "bad_signature", "too_large", "wrong_author")

PeerId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$")]
Seq = Annotated[int, Field(ge=0, le=MAX_SEQ)]
HeldSeq = Annotated[int, Field(ge=1, le=MAX_SEQ)]
Hex64 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class MessageError(ValueError):
    """A peer's message that this node refuses; ``reason`` is what the rejection is counted as."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="forbid")


M = TypeVar("M", bound=_Strict)
_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}


# ---- update headers (notify streams and DHT announcements) ------------------------------------


def parse_signed_header(
    blob: object, *, author: str | None = None, seq: int | None = None
) -> SignedHeader:
    """A header as received, its signature verified; checked against the key it came under.

    Nothing about an author may be stored or marked before this returns: a header that names
    an author it is not signed by is refused here, on every path.
    """
    if not isinstance(blob, bytes):
        raise MessageError("malformed", "a header is bytes")
    if len(blob) > MAX_SIGNED_HEADER_BYTES:
        raise MessageError("too_large", f"header of {len(blob)} bytes")
    try:
        signed = SignedHeader.from_bytes(blob)
        verify_header(signed)
    except EnvelopeError as exc:
        reason = "bad_signature" if exc.reason == "bad_signature" else "malformed"
        raise MessageError(reason, str(exc)) from None
    header = signed.header
    if (author is not None and header.author != author) or (seq is not None and header.seq != seq):
        raise MessageError("wrong_author", "the header disagrees with the key it was found under")
    return signed


# ---- DHT records --------------------------------------------------------------------------------


MAX_HOLDER_RANGES = 16
"""Seq ranges one holder record names (its newest): a node retains 16 updates per author by
default (dht.swarm_config.retain_updates), so an honest record never needs more."""


class HolderRecord(_Strict):
    """`holders/AUTHOR` subkey "[owner:HOLDER]" -> [[lo, hi], ...]: HOLDER retains AUTHOR's
    updates in those inclusive seq ranges (sorted, disjoint, at most MAX_HOLDER_RANGES).

    One subkey per holder, rewritten as what it retains changes: the record holds one entry
    per holder however many updates the author publishes. (One subkey per (holder, seq), as
    before, grew to ~120 signed subkeys under a flood within the 60 s TTL, and hivemind checks
    every subkey's signature on each store and get: 435 ms a store at 220 subkeys, in the DHT
    process that heartbeat reads wait on.) The older form "[owner:HOLDER]SEQ" -> true is still
    read, as the range (SEQ, SEQ). Only HOLDER can write its subkey
    (dht.records.OwnerValidator): nobody can list another peer as a holder, or erase its entry.
    """

    holder: PeerId
    ranges: Annotated[tuple[tuple[HeldSeq, HeldSeq], ...], Field(max_length=MAX_HOLDER_RANGES)]


def holder_subkey(holder: str) -> str:
    return owner_subkey(holder)


def holder_ranges(seqs: Iterable[int]) -> list[list[int]]:
    """The holder record's value naming `seqs`: their newest MAX_HOLDER_RANGES ranges."""
    return [[lo, hi] for lo, hi in to_runs(seqs)[-MAX_HOLDER_RANGES:]]


def parse_holder(subkey: object, value: object) -> HolderRecord:
    holder = subkey_owner(subkey)
    if holder is not None and subkey == holder_subkey(holder):
        return _validated(HolderRecord, {"holder": holder, "ranges": _holder_ranges(value)})
    if value is not True:
        raise MessageError("malformed", "holder records are '[owner:PEER_ID]' -> seq ranges")
    holder, seq = _owned_seq(subkey)  # the older form, one seq a subkey
    return _validated(HolderRecord, {"holder": holder, "ranges": ((seq, seq),)})


def _holder_ranges(value: object) -> tuple[tuple[int, int], ...]:
    """Sorted, disjoint [lo, hi] pairs of ints (not bools), sized before they are walked."""
    if not isinstance(value, list | tuple) or not 0 < len(value) <= MAX_HOLDER_RANGES:
        raise MessageError("malformed", f"a holder record names 1 to {MAX_HOLDER_RANGES} ranges")
    ranges: list[tuple[int, int]] = []
    for pair in value:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise MessageError("malformed", "a holder record's range is [lo, hi]")
        lo, hi = pair
        if not all(type(end) is int for end in (lo, hi)) or not 1 <= lo <= hi <= MAX_SEQ:
            raise MessageError("malformed", "a holder record's range is out of bounds")
        if ranges and lo <= ranges[-1][1]:
            raise MessageError("malformed", "a holder record's ranges are not sorted and disjoint")
        ranges.append((lo, hi))
    return tuple(ranges)


def announcement_subkey(author: str, seq: int) -> str:
    """`updates/AUTHOR` subkey of AUTHOR's update SEQ: only AUTHOR can write it."""
    return owner_subkey(author, str(seq))


def parse_announced_seq(subkey: object, author: str) -> int:
    """The seq an `updates/AUTHOR` subkey names; MessageError unless AUTHOR owns it."""
    owner, seq = _owned_seq(subkey)
    if owner != author:
        raise MessageError("wrong_author", "an announcement under another author's key")
    return seq


def _owned_seq(subkey: object) -> tuple[str, int]:
    """(owner, seq) of a "[owner:PEER_ID]SEQ" subkey."""
    owner = subkey_owner(subkey)
    if owner is None or not isinstance(subkey, str):
        raise MessageError("malformed", "the subkey is not '[owner:PEER_ID]SEQ'")
    digits = subkey[len(owner_subkey(owner)) :]
    if not digits.isascii() or not digits.isdigit() or len(digits) > 16:
        raise MessageError("malformed", "the subkey's seq is not a number")
    seq = int(digits)
    if not 1 <= seq <= MAX_SEQ:
        raise MessageError("malformed", "the subkey's seq is out of range")
    return owner, seq


_Setting = str | int | float | bool | None


class RunRecord(_Strict):
    """`diloco-run/RUN_ID` subkey FINGERPRINT -> the run's settings as JSON (shown to people)."""

    fingerprint: Hex64
    summary: dict[str, _Setting | dict[str, _Setting]]
    """Flat settings, and one level of nesting (the non-default fingerprint settings)."""


def parse_run_record(subkey: object, value: object) -> RunRecord:
    if not isinstance(value, str) or len(value) > MAX_RUN_SUMMARY_BYTES:
        raise MessageError("malformed", "a run record is a JSON string of at most 4 KiB")
    try:
        summary = json.loads(value)
    except (ValueError, RecursionError):
        raise MessageError("malformed", "a run record is not JSON") from None
    return _validated(RunRecord, {"fingerprint": subkey, "summary": summary})


RUN_LISTING_KEY = "diloco-runs"
"""Subkey RUN_ID -> True for every run trained in this DHT: how `status` and `dashboard` find
runs when no --run-id is given. Anyone can add a name; what a name shows is still verified."""
MAX_RUN_ID_CHARS = 64


def parse_run_listing(subkey: object) -> str:
    """A run id listed under RUN_LISTING_KEY."""
    if not isinstance(subkey, str) or not 0 < len(subkey) <= MAX_RUN_ID_CHARS:
        raise MessageError("malformed", "a listed run id is a string of 1 to 64 characters")
    if not subkey.isprintable():
        raise MessageError("malformed", "a listed run id has unprintable characters")
    return subkey


# ---- state manifests ----------------------------------------------------------------------------


class TensorEntry(_Strict):
    dtype: Literal["float32", "float16", "bfloat16", "int64"]
    shape: Annotated[
        list[Annotated[int, Field(ge=0, lt=MAX_TENSOR_DIM)]], Field(max_length=MAX_TENSOR_DIMS)
    ]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * _ITEM_BYTES[self.dtype]


class StateManifest(_Strict):
    """The head of a state stream: the replica's JSON tree and the tensors that follow it."""

    tree: dict[str, object]
    tensors: Annotated[list[TensorEntry], Field(max_length=MAX_STATE_TENSORS)]

    @property
    def num_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def parse_state_manifest(raw: object, *, max_state_bytes: int) -> StateManifest:
    """The manifest of a state stream; its announced tensors are sized before any is read."""
    if not isinstance(raw, bytes | bytearray):
        raise MessageError("malformed", "a state manifest is bytes")
    if len(raw) > MAX_STATE_META_BYTES:
        raise MessageError("too_large", f"state manifest of {len(raw)} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise MessageError("malformed", "the state manifest is not JSON") from None
    manifest = _validated(StateManifest, data)
    if manifest.num_bytes > max_state_bytes:
        raise MessageError("too_large", f"state of {manifest.num_bytes} bytes exceeds the cap")
    return manifest


# ---- state seals --------------------------------------------------------------------------------

SEAL_MAGIC = b"DLS1"
SEAL_DOMAIN = b"diloco-node state seal\n"
"""Prefixed to what a seal's signature covers: no other signed message of this key (headers,
heartbeats) can pass for a seal."""
MAX_SEAL_BYTES = 4096


class StateSeal(_Strict):
    """The donor's signature over the state it just streamed, sent after the last tensor: the
    BLAKE3 of the manifest's bytes and every tensor byte as sent, and the applied set they
    hold. A state whose bytes do not hash to it, or a seal its donor did not sign, is refused;
    a signed seal over a bad state is the donor's own evidence against itself."""

    fingerprint: Hex64
    donor: PeerId
    num_bytes: Annotated[int, Field(ge=0)]
    state_blake3: Hex64
    num_applied: Annotated[int, Field(ge=0)]
    applied_digest: Hex64

    def sign(self, identity: Identity) -> bytes:
        if identity.peer_id != self.donor:
            raise ValueError("a state seal must be signed by its donor")
        raw = json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":")).encode()
        return SEAL_MAGIC + raw + identity.sign(SEAL_DOMAIN + raw)


def parse_state_seal(blob: object, *, donor: str) -> StateSeal:
    """A seal as received from `donor`; MessageError unless `donor` signed it."""
    if not isinstance(blob, bytes):
        raise MessageError("malformed", "a state seal is bytes")
    if len(blob) > MAX_SEAL_BYTES:
        raise MessageError("too_large", f"state seal of {len(blob)} bytes")
    if len(blob) < len(SEAL_MAGIC) + SIGNATURE_BYTES or not blob.startswith(SEAL_MAGIC):
        raise MessageError("malformed", "not a state seal")
    raw, signature = blob[len(SEAL_MAGIC) : -SIGNATURE_BYTES], blob[-SIGNATURE_BYTES:]
    if not verify_signature(donor, SEAL_DOMAIN + raw, signature):
        raise MessageError("bad_signature", "the state seal is not signed by its donor")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        raise MessageError("malformed", "the state seal is not JSON") from None
    seal = _validated(StateSeal, data)
    if seal.donor != donor:
        raise MessageError("wrong_author", "the state seal names another donor")
    return seal


def _validated(model: type[M], data: object) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or model.__name__
        raise MessageError("malformed", f"{model.__name__} {where}: {first['msg']}") from None
