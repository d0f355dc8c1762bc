"""The signed envelope around a pseudo-gradient: header, Ed25519 signature, payload.

The header is small (< 1 KB as a :class:`SignedHeader` blob) so it can be announced in the
DHT; the payload travels separately and is bound to the header by its hash. The signature
covers the header's canonical JSON, and parsing accepts only that canonical encoding, so a
header has exactly one byte string on the wire.

Header versions: v1 (the original fields), v2 (adds ``learners``, the author's count of
live learners), v3 (binds the payload by BLAKE3, ``payload_blake3``, instead of SHA-256,
``payload_sha256``: several times faster, so that merging keeps up with hashing) and v4 (v3
plus ``fragment`` and ``fragments``: the payload is fragment p of P of the model, see
merge.fragments; a run with P = 1 keeps sealing v3). All parse;
a header re-serialises to the version it was signed in, and its payload is checked with the
hash that version names.

The flush marker: a v3 or v4 header may carry ``"flush": true`` (never ``false``: absent is
the one encoding of "not a flush", so a header without it, as every one sealed before, parses
and re-serialises as before). It says the payload is its author's error feedback residual,
sent once when it stops (node.publishing's flush): replicas apply it as a plain step, no
outer momentum (merge.outer.OuterOptimizer.plain_step). It is signed, so every replica applies
a flush alike.

Wire formats (integers little-endian):
    SignedHeader: b"DLH1" | u32 header length | canonical header JSON | 64-byte signature
    SignedUpdate: b"DLU1" | u32 header length | canonical header JSON | 64-byte signature | payload
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
import struct
import time
from dataclasses import dataclass
from typing import Any

import blake3

from merge.identity import Identity, verify_signature

ENVELOPE_VERSION = 3
"""The version :func:`seal` writes for a whole-model update (v4 for a fragment); version 1
and 2 headers still parse."""
MAX_HEADER_JSON_BYTES = 4096
SIGNATURE_BYTES = 64
HEADER_MAGIC = b"DLH1"
UPDATE_MAGIC = b"DLU1"
REASONS = frozenset({"malformed", "bad_signature", "payload_hash_mismatch"})

_HEX64 = re.compile(r"[0-9a-f]{64}")
_LENGTH = struct.Struct("<I")
_PREFIX_BYTES = len(HEADER_MAGIC) + _LENGTH.size
_MAX_AUTHOR_CHARS = 128
_MAX_CODEC_CHARS = 16
_MAX_ABS_INT = 2**63 - 1
_INT_FIELDS = ("seq", "base_applied", "published_applied", "inner_steps", "tokens", "numel")
_V2_FIELDS = ("learners",)
"""Fields a version 2 header adds (None in a version 1 header)."""
_V4_FIELDS = ("fragment", "fragments")
"""Fields a version 4 header adds (None in earlier versions)."""
FLUSH_KEY = "flush"
"""The optional key of a v3 or v4 header that marks a flush (only ever ``true``)."""
_PAYLOAD_HASH_FIELDS = {
    1: "payload_sha256", 2: "payload_sha256", 3: "payload_blake3", 4: "payload_blake3",
}  # fmt: skip
"""The field that binds the payload in each version; the other one is None."""
MAX_HEADER_LOSS = 1e6
"""A finite header loss lies in [-MAX_HEADER_LOSS, MAX_HEADER_LOSS]: a loss of 10**400 raised
OverflowError wherever it was turned into a float. A NaN or infinite float loss still parses:
the pipeline refuses it as "non_finite", counted against its author."""
MAX_CREATED_AT = 1e10
"""A header's created_at is finite, in [0, MAX_CREATED_AT] seconds (the year 2286)."""
_NUMBER_BOUNDS = {"loss": MAX_HEADER_LOSS, "created_at": MAX_CREATED_AT}


class EnvelopeError(ValueError):
    """An update envelope failed to parse or verify; ``reason`` names the failure."""

    def __init__(self, reason: str, detail: str = "") -> None:
        assert reason in REASONS, reason
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, kw_only=True)
class UpdateHeader:
    """What an author claims about one pseudo-gradient; everything a receiver weighs it by."""

    fingerprint: str
    """Hex SHA-256 of the run's configuration; updates from another run are refused."""
    author: str
    """The author's libp2p peer id; its Ed25519 public key checks the signature."""
    seq: int
    """The author's update counter; (author, seq) identifies the update."""
    base_applied: int
    """Updates the author's replica had applied when this round started."""
    published_applied: int
    """Updates the author's replica had applied when it published this update."""
    inner_steps: int
    """Inner optimizer steps taken in the round."""
    tokens: int
    """Tokens processed in the round."""
    loss: float
    """The author's mean training loss over the round (informational)."""
    payload_sha256: str | None = None
    """Hex SHA-256 of the encoded payload (v1 and v2 headers; None in v3)."""
    payload_blake3: str | None = None
    """Hex BLAKE3 (32 bytes) of the encoded payload (v3 headers; None in v1 and v2)."""
    codec: str
    """Name of the codec the payload is encoded with (see merge.codecs)."""
    numel: int
    """Number of elements in the pseudo-gradient."""
    created_at: float
    """Unix time in seconds when the author sealed the update."""
    learners: int | None = None
    """Live learners the author counted when it published, itself included (v2; None in v1
    headers). One round of that many updates makes one outer step (see merge.outer)."""
    fragment: int | None = None
    """v4: which fragment of the model the payload is, in [0, fragments); None in v1 to v3
    headers, whose payload is the whole model."""
    fragments: int | None = None
    """v4: P, the number of fragments the run splits the model into (merge.fragments)."""
    flush: bool = False
    """v3 and v4: the payload is the author's error feedback residual, sent once as it stops;
    applied with no outer momentum (merge.outer). On the wire only when true."""

    def __post_init__(self) -> None:
        _check_header_fields(self)

    @property
    def staleness(self) -> int:
        """Updates the author's replica applied while the round ran."""
        return self.published_applied - self.base_applied

    @property
    def update_id(self) -> tuple[str, int]:
        return (self.author, self.seq)

    @property
    def version(self) -> int:
        """4 for a fragment; 3 for a payload bound by BLAKE3; else 1 or 2 (v2 fields)."""
        if self.fragment is not None:
            return 4
        if self.payload_blake3 is not None:
            return 3
        return 1 if self.learners is None else 2

    @property
    def payload_digest(self) -> str:
        """The payload's hash, named by its algorithm: equal for equal payloads of a version."""
        field = _PAYLOAD_HASH_FIELDS[self.version]
        return f"{field.removeprefix('payload_')}:{getattr(self, field)}"

    def to_dict(self) -> dict[str, Any]:
        """The wire dict: the fields of its version plus the envelope version ``"v"``."""
        d = dataclasses.asdict(self)
        wire = {k: v for k, v in d.items() if k in _WIRE_KEYS[self.version]}
        return wire | ({FLUSH_KEY: True} if self.flush else {}) | {"v": self.version}

    @classmethod
    def from_dict(cls, d: object) -> UpdateHeader:
        """Parses an untrusted wire dict; raises EnvelopeError("malformed") on any deviation."""
        if not isinstance(d, dict):
            raise EnvelopeError("malformed", "header is not a JSON object")
        version = d.get("v")
        if type(version) is not int or version not in _WIRE_KEYS:
            raise EnvelopeError("malformed", f"unsupported envelope version {version!r}")
        if set(d) - {FLUSH_KEY} != _WIRE_KEYS[version]:
            raise EnvelopeError("malformed", "header keys differ from the expected set")
        if FLUSH_KEY in d and (d[FLUSH_KEY] is not True or version < 3):
            raise EnvelopeError("malformed", "flush is only ever true, in a v3 or v4 header")
        header = cls(**{k: v for k, v in d.items() if k != "v"})
        if header.version != version:
            raise EnvelopeError("malformed", f"a v{version} header needs its v{version} fields")
        return header

    def canonical_bytes(self) -> bytes:
        """The deterministic JSON encoding that the signature covers."""
        return json.dumps(
            self.to_dict(), sort_keys=True, separators=(",", ":"), ensure_ascii=True
        ).encode("ascii")


_ALL_KEYS = (frozenset(f.name for f in dataclasses.fields(UpdateHeader)) - {FLUSH_KEY}) | {"v"}
_V2_KEYS = _ALL_KEYS - {"payload_blake3", *_V4_FIELDS}
_V4_KEYS = _ALL_KEYS - {"payload_sha256"}
_WIRE_KEYS = {
    1: _V2_KEYS - set(_V2_FIELDS), 2: _V2_KEYS, 3: _V4_KEYS - set(_V4_FIELDS), 4: _V4_KEYS,
}  # fmt: skip
"""The exact key set of each envelope version's header."""


@dataclass(frozen=True)
class SignedHeader:
    """A header with its author's signature: what is announced before the payload is fetched."""

    header: UpdateHeader
    signature: bytes

    def to_bytes(self) -> bytes:
        return _pack(HEADER_MAGIC, self.header, self.signature)

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedHeader:
        header, signature, end = _unpack(HEADER_MAGIC, data)
        if end != len(data):
            raise EnvelopeError("malformed", "trailing bytes after the signature")
        return cls(header, signature)


@dataclass(frozen=True)
class SignedUpdate:
    """A signed header with the encoded pseudo-gradient it describes."""

    header: UpdateHeader
    signature: bytes
    payload: bytes | memoryview
    """The encoded pseudo-gradient; parsed updates hold a read-only view into the envelope."""

    @property
    def signed_header(self) -> SignedHeader:
        return SignedHeader(self.header, self.signature)

    def to_bytes(self) -> bytes:
        return b"".join((_pack(UPDATE_MAGIC, self.header, self.signature), self.payload))

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedUpdate:
        """Parses without copying the payload out of immutable ``data`` (it can be 100s of MB)."""
        header, signature, end = _unpack(UPDATE_MAGIC, data)
        payload = _byte_view(data)[end:]
        return cls(header, signature, payload if payload.readonly else bytes(payload))


def seal(
    identity: Identity,
    *,
    fingerprint: str,
    seq: int,
    base_applied: int,
    published_applied: int,
    inner_steps: int,
    tokens: int,
    loss: float,
    codec: str,
    numel: int,
    payload: bytes,
    created_at: float | None = None,
    learners: int = 1,
    fragment: int | None = None,
    fragments: int | None = None,
    flush: bool = False,
) -> SignedUpdate:
    """Signs a payload and its header with ``identity``: version 3, or 4 for a fragment;
    ``flush`` marks it as its author's residual, sent once as it stops (module docstring)."""
    header = UpdateHeader(
        fingerprint=fingerprint,
        author=identity.peer_id,
        seq=seq,
        base_applied=base_applied,
        published_applied=published_applied,
        inner_steps=inner_steps,
        tokens=tokens,
        loss=sealable_loss(loss),
        payload_blake3=blake3.blake3(payload).hexdigest(),
        codec=codec,
        numel=numel,
        created_at=time.time() if created_at is None else float(created_at),
        learners=learners,
        fragment=fragment,
        fragments=fragments,
        flush=flush,
    )
    return SignedUpdate(header, identity.sign(header.canonical_bytes()), payload)


def sealable_loss(loss: float) -> float:
    """The loss a header carries: a finite one clamped to MAX_HEADER_LOSS (peers refuse more);
    NaN or infinity as is, for the pipeline to refuse as "non_finite"."""
    value = float(loss)
    return max(-MAX_HEADER_LOSS, min(MAX_HEADER_LOSS, value)) if math.isfinite(value) else value


def verify_header(signed: SignedHeader) -> None:
    """Raises EnvelopeError("bad_signature") unless the author's key signed the header."""
    if not verify_signature(
        signed.header.author, signed.header.canonical_bytes(), signed.signature
    ):
        raise EnvelopeError("bad_signature", f"header signature of {signed.header.author} fails")


def verify(update: SignedUpdate) -> None:
    """Checks the signature, then that the payload is the one the header names."""
    verify_header(update.signed_header)
    if not payload_matches(update.header, update.payload):
        raise EnvelopeError("payload_hash_mismatch", f"payload of {update.header.update_id}")


def payload_matches(
    header: UpdateHeader, payload: bytes | memoryview, *, max_threads: int = 1
) -> bool:
    """Whether ``payload`` hashes to what the header names, by its version's hash.

    BLAKE3 (v3, v4) hashes a large payload on up to ``max_threads`` threads (its tree splits
    into independent chunks; the digest is the same): on an idle 2-core machine two threads
    hash ~1.8x as fast as one, on a loaded one they buy nothing. SHA-256 (v1, v2) is serial.
    """
    if header.payload_blake3 is not None:  # v3 and v4
        return blake3_hex(payload, max_threads) == header.payload_blake3
    return hashlib.sha256(payload).hexdigest() == header.payload_sha256


PARALLEL_HASH_MIN_BYTES = 1 << 20
"""Smaller payloads are hashed on one thread: below ~1 MiB the thread pool costs more than
it saves."""


def blake3_hex(payload: bytes | memoryview, max_threads: int = 1) -> str:
    """Hex BLAKE3 of ``payload``, on up to ``max_threads`` threads when it is large."""
    size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
    if max_threads > 1 and size >= PARALLEL_HASH_MIN_BYTES:
        return blake3.blake3(payload, max_threads=max_threads).hexdigest()
    return blake3.blake3(payload).hexdigest()


def _check_header_fields(h: UpdateHeader) -> None:
    for name in _INT_FIELDS:
        value = getattr(h, name)
        if type(value) is not int or abs(value) > _MAX_ABS_INT:
            raise EnvelopeError("malformed", f"{name} must be a 64-bit integer")
    for name in _V2_FIELDS:
        value = getattr(h, name)
        if value is not None and (type(value) is not int or abs(value) > _MAX_ABS_INT):
            raise EnvelopeError("malformed", f"{name} must be a 64-bit integer")
    for name, bound in _NUMBER_BOUNDS.items():
        value = getattr(h, name)
        if type(value) not in (int, float) or not _within(value, bound, name == "loss"):
            raise EnvelopeError("malformed", f"{name} must be a finite number within {bound:g}")
    if h.created_at < 0:
        raise EnvelopeError("malformed", "created_at must be >= 0")
    _check_string(h.fingerprint, "fingerprint", 64, hex64=True)
    _check_fragment(h)
    _check_payload_hash(h)
    if type(h.flush) is not bool or (h.flush and h.version < 3):
        raise EnvelopeError("malformed", "flush must be a bool, true only in a v3 or v4 header")
    _check_string(h.author, "author", _MAX_AUTHOR_CHARS)
    _check_string(h.codec, "codec", _MAX_CODEC_CHARS)


def _within(value: float, bound: float, non_finite_ok: bool) -> bool:
    """|value| <= bound, without turning a huge int into a float (OverflowError); NaN and
    infinities pass only where `non_finite_ok` (the pipeline judges them)."""
    if type(value) is int:
        return -bound <= value <= bound
    if not math.isfinite(value):
        return non_finite_ok
    return abs(value) <= bound


def _check_fragment(h: UpdateHeader) -> None:
    """Both fragment fields or neither; fragment p of P with 0 <= p < P."""
    p, count = h.fragment, h.fragments
    if p is None and count is None:
        return
    if type(p) is not int or type(count) is not int or not 0 <= p < count <= _MAX_ABS_INT:
        raise EnvelopeError("malformed", "fragment must be an integer in [0, fragments)")


def _check_payload_hash(h: UpdateHeader) -> None:
    """Exactly the hash field of the header's version is set, to 64 hex characters."""
    if h.payload_blake3 is not None and (h.payload_sha256 is not None or h.learners is None):
        raise EnvelopeError("malformed", "a v3 header has payload_blake3 and learners only")
    field = _PAYLOAD_HASH_FIELDS[h.version]
    _check_string(getattr(h, field), field, 64, hex64=True)


def _check_string(value: object, name: str, max_chars: int, *, hex64: bool = False) -> None:
    if type(value) is not str or not 0 < len(value) <= max_chars:
        raise EnvelopeError("malformed", f"{name} must be a string of 1 to {max_chars} characters")
    if hex64 and not _HEX64.fullmatch(value):
        raise EnvelopeError("malformed", f"{name} must be 64 lowercase hex characters")


def _pack(magic: bytes, header: UpdateHeader, signature: bytes) -> bytes:
    if len(signature) != SIGNATURE_BYTES:
        raise EnvelopeError("malformed", f"signature must have {SIGNATURE_BYTES} bytes")
    header_json = header.canonical_bytes()
    return magic + _LENGTH.pack(len(header_json)) + header_json + signature


def _byte_view(data: object) -> memoryview:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise EnvelopeError("malformed", "envelope is not bytes")
    try:
        return memoryview(data).cast("B")
    except TypeError as e:
        raise EnvelopeError("malformed", "envelope is not a flat byte buffer") from e


def _unpack(magic: bytes, data: object) -> tuple[UpdateHeader, bytes, int]:
    """Parses magic, header and signature; returns them with the offset just past them."""
    view = _byte_view(data)
    if len(view) < _PREFIX_BYTES or view[: len(magic)] != magic:
        raise EnvelopeError("malformed", f"envelope does not start with {magic!r}")
    (header_len,) = _LENGTH.unpack(view[len(magic) : _PREFIX_BYTES])
    end = _PREFIX_BYTES + header_len + SIGNATURE_BYTES
    if header_len > MAX_HEADER_JSON_BYTES or len(view) < end:
        raise EnvelopeError("malformed", "header length out of range")
    header_json = bytes(view[_PREFIX_BYTES : _PREFIX_BYTES + header_len])
    header = _parse_header_json(header_json)
    return header, bytes(view[end - SIGNATURE_BYTES : end]), end


def _parse_header_json(header_json: bytes) -> UpdateHeader:
    try:
        header = UpdateHeader.from_dict(json.loads(header_json))
    except EnvelopeError:
        raise
    except (ValueError, TypeError, RecursionError) as e:
        raise EnvelopeError("malformed", "header is not valid JSON") from e
    if header.canonical_bytes() != header_json:
        raise EnvelopeError("malformed", "header JSON is not in canonical form")
    return header
