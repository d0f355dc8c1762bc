"""DHT records only their owner can write: an Ed25519 record validator for hivemind's DHT.

hivemind keeps, for each dictionary subkey, the value with the latest expiration, whoever
stored it: anyone could overwrite a peer's heartbeat (subkey = its peer id) with a later
expiration and hide that peer from the swarm. A subkey that contains ``[owner:PEER_ID]`` is
protected by :class:`OwnerValidator`: its value must carry PEER_ID's Ed25519 signature over
the whole record (key, subkey, value and expiration), so

- a foreign write (another key, or a forged signature) is refused by every honest DHT member
  on store, and by the reader on get;
- a replay of the owner's own older record cannot win: its expiration is older than the
  owner's newest record's, and a far-future expiration cannot be attached without the
  owner's key.

It follows hivemind's own RSASignatureValidator (hivemind/dht/crypto.py), for the Ed25519
keys that name peers here. Every DHT member of the swarm, the observer included, runs it.

Every record of this swarm is a dictionary entry with a string subkey, so the validator also
refuses any other record: a plain (subkey-less) value with a later expiration would replace a
whole dictionary (every heartbeat at once), and subkeys of mixed types under one key make
hivemind's storage raise TypeError (its expiration heap compares (expiration, subkey)
tuples) on every later store and get of that key.

And every value is size-bounded (MAX_VALUE_BYTES, far above the largest honest value, a
16 KiB heartbeat): hivemind stores whatever a peer sends, so one peer could park megabytes
in every DHT member's memory and in every reader's lookups.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import re

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from merge.identity import Identity, verify_signature

_OWNER_RE = re.compile(rb"\[owner:([1-9A-HJ-NP-Za-km-z]{1,128})\]")
_OWNER_PREFIX = re.compile(r"\[owner:([1-9A-HJ-NP-Za-km-z]{1,128})\]")
_SIGNATURE_MARK = b"[ed25519]"
_SIGNATURE_BYTES = 64
_SUFFIX_BYTES = len(_SIGNATURE_MARK) + _SIGNATURE_BYTES
MAX_SUBKEY_CHARS = 256
MAX_VALUE_BYTES = 32 * 1024
"""The largest serialized value a record may hold: a heartbeat (16 KiB body), a signed
header (~4 KiB) or a run record (4 KiB), with their signatures, fit with room to spare."""


def owner_subkey(peer_id: str, suffix: str = "") -> str:
    """A subkey only `peer_id` may write (for example its heartbeat's)."""
    return f"[owner:{peer_id}]{suffix}"


def subkey_owner(subkey: object) -> str | None:
    """The peer id that owns a protected subkey, or None for any other subkey."""
    found = _OWNER_PREFIX.match(subkey) if isinstance(subkey, str) else None
    return found.group(1) if found else None


REFUSALS = (
    "dht_record_subkey",
    "dht_record_unsigned",
    "dht_record_bad_signature",
    "dht_record_too_large",
)
"""Why the validator refused a record: not a dictionary entry with a string subkey (a plain
value, an int subkey); a protected subkey without its owner's signature; a signature that
does not verify (a foreign write, such as an overwritten heartbeat); a value over
MAX_VALUE_BYTES."""


class RefusalCounts:
    """How many records the validator refused, per reason (REFUSALS), in memory shared with
    the DHT's forked process, where hivemind runs validators: the node reads them (a count of
    refusals, not of distinct records: a record is judged again on every store and get that
    brings it). Create it before the DHT process starts."""

    def __init__(self) -> None:
        self._counts = multiprocessing.get_context("fork").Array("q", len(REFUSALS))

    def add(self, reason: str) -> None:
        with self._counts.get_lock():
            self._counts[REFUSALS.index(reason)] += 1

    def snapshot(self) -> dict[str, int]:
        with self._counts.get_lock():
            return dict(zip(REFUSALS, self._counts[:], strict=True))


class OwnerValidator(RecordValidatorBase):
    """Signs this node's protected records; refuses protected records its owner did not sign.

    ``identity`` is None for a read-only member (the observer): it validates, signs nothing.
    ``refusals``, when given, counts what it refuses.
    """

    def __init__(
        self, identity: Identity | None = None, refusals: RefusalCounts | None = None
    ) -> None:
        self._identity = identity
        self._refusals = refusals

    def validate(self, record: DHTRecord) -> bool:
        reason = self._refusal(record)
        if reason is not None and self._refusals is not None:
            self._refusals.add(reason)
        return reason is None

    def _refusal(self, record: DHTRecord) -> str | None:
        if len(record.value) > MAX_VALUE_BYTES:
            return "dht_record_too_large"
        if not _is_string_subkey(record.subkey):
            return "dht_record_subkey"
        owners = set(_OWNER_RE.findall(record.subkey))
        if not owners:
            return None  # not a protected record
        if len(owners) > 1 or len(record.value) < _SUFFIX_BYTES:
            return "dht_record_unsigned"
        value, mark, signature = _split(record.value)
        if mark != _SIGNATURE_MARK:
            return "dht_record_unsigned"
        owner = owners.pop().decode()
        stripped = dataclasses.replace(record, value=value)
        ok = verify_signature(owner, _serialize(stripped), signature)
        return None if ok else "dht_record_bad_signature"

    def sign_value(self, record: DHTRecord) -> bytes:
        owners = set(_OWNER_RE.findall(record.subkey or b""))
        if self._identity is None or owners != {self._identity.peer_id.encode()}:
            return record.value
        return record.value + _SIGNATURE_MARK + self._identity.sign(_serialize(record))

    def strip_value(self, record: DHTRecord) -> bytes:
        if not _OWNER_RE.search(record.subkey or b"") or len(record.value) < _SUFFIX_BYTES:
            return record.value
        return _split(record.value)[0]

    @property
    def priority(self) -> int:
        return 10  # like RSASignatureValidator: signs last, validates and strips first

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


def _is_string_subkey(subkey: bytes | None) -> bool:
    """Whether a record's serialized subkey is a string of at most MAX_SUBKEY_CHARS."""
    if not subkey or len(subkey) > 4 * MAX_SUBKEY_CHARS + 8:
        return False
    try:
        value = MSGPackSerializer.loads(subkey)
    except Exception:  # whatever msgpack makes of a peer's bytes
        return False
    return isinstance(value, str) and len(value) <= MAX_SUBKEY_CHARS


def _split(value: bytes) -> tuple[bytes, bytes, bytes]:
    body, suffix = value[:-_SUFFIX_BYTES], value[-_SUFFIX_BYTES:]
    return body, suffix[: len(_SIGNATURE_MARK)], suffix[len(_SIGNATURE_MARK) :]


def _serialize(record: DHTRecord) -> bytes:
    return MSGPackSerializer.dumps(dataclasses.astuple(record))
