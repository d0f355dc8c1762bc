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
"""

from __future__ import annotations

import dataclasses
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


def owner_subkey(peer_id: str, suffix: str = "") -> str:
    """A subkey only `peer_id` may write (for example its heartbeat's)."""
    return f"[owner:{peer_id}]{suffix}"


def subkey_owner(subkey: object) -> str | None:
    """The peer id that owns a protected subkey, or None for any other subkey."""
    found = _OWNER_PREFIX.match(subkey) if isinstance(subkey, str) else None
    return found.group(1) if found else None


class OwnerValidator(RecordValidatorBase):
    """Signs this node's protected records; refuses protected records its owner did not sign.

    ``identity`` is None for a read-only member (the observer): it validates, signs nothing.
    """

    def __init__(self, identity: Identity | None = None) -> None:
        self._identity = identity

    def validate(self, record: DHTRecord) -> bool:
        if not _is_string_subkey(record.subkey):
            return False
        owners = set(_OWNER_RE.findall(record.subkey))
        if not owners:
            return True  # not a protected record
        if len(owners) > 1 or len(record.value) < _SUFFIX_BYTES:
            return False
        value, mark, signature = _split(record.value)
        if mark != _SIGNATURE_MARK:
            return False
        owner = owners.pop().decode()
        stripped = dataclasses.replace(record, value=value)
        return verify_signature(owner, _serialize(stripped), signature)

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
