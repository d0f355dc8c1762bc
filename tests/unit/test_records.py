"""OwnerValidator on its own: a protected record is valid only as its owner signed it."""

from __future__ import annotations

import dataclasses

from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from dht.records import MAX_VALUE_BYTES, OwnerValidator, RefusalCounts, owner_subkey, subkey_owner
from merge.identity import Identity

OWNER, OTHER = Identity.generate(), Identity.generate()


def record(identity: Identity, value: bytes = b"beat", expiration: float = 100.0) -> DHTRecord:
    subkey = MSGPackSerializer.dumps(owner_subkey(identity.peer_id))
    return DHTRecord(b"key-id", subkey, value, expiration)


def signed(identity: Identity, **changes: object) -> DHTRecord:
    plain = record(identity)
    value = OwnerValidator(identity).sign_value(plain)
    return dataclasses.replace(plain, value=value, **changes)  # type: ignore[arg-type]


def test_the_owner_signs_and_everyone_validates_and_strips() -> None:
    reader = OwnerValidator()
    good = signed(OWNER)
    assert reader.validate(good) and reader.strip_value(good) == b"beat"


def test_tampering_with_value_expiration_or_key_invalidates_it() -> None:
    reader = OwnerValidator()
    good = signed(OWNER)
    assert not reader.validate(dataclasses.replace(good, value=b"x" + good.value))
    assert not reader.validate(dataclasses.replace(good, expiration_time=10**9))
    assert not reader.validate(dataclasses.replace(good, key=b"other-key"))


def test_nobody_else_can_write_or_sign_the_owners_subkey() -> None:
    reader = OwnerValidator()
    assert not reader.validate(record(OWNER))  # unsigned
    assert OwnerValidator(OTHER).sign_value(record(OWNER)) == b"beat"  # refuses to sign
    theirs = signed(OTHER)
    assert not reader.validate(dataclasses.replace(theirs, subkey=record(OWNER).subkey))


def test_unprotected_records_pass_untouched() -> None:
    plain = DHTRecord(b"k", MSGPackSerializer.dumps("fingerprint"), b"v", 1.0)
    assert OwnerValidator(OWNER).validate(plain)
    assert OwnerValidator(OWNER).sign_value(plain) == b"v"
    assert subkey_owner("fingerprint") is None and subkey_owner(7) is None


def test_only_string_subkeys_are_valid_records() -> None:
    """A plain value would replace a whole dictionary record (every heartbeat at once), and
    subkeys of mixed types make hivemind's storage raise TypeError: both are refused."""
    reader = OwnerValidator()
    for subkey in (None, 7, -1, 2.5, b"raw", True, [1], "x" * 300):
        record = DHTRecord(b"k", MSGPackSerializer.dumps(subkey), b"v", 1.0)
        assert not reader.validate(record), subkey
    for junk in (b"", b"\xc1", b"\xda\xff\xff"):
        assert not reader.validate(DHTRecord(b"k", junk, b"v", 1.0))


def test_a_value_over_the_size_bound_is_refused_and_counted_even_when_signed() -> None:
    refusals = RefusalCounts()
    reader = OwnerValidator(refusals=refusals)
    big = b"x" * (MAX_VALUE_BYTES + 1)
    plain = DHTRecord(b"k", MSGPackSerializer.dumps("fingerprint"), big, 1.0)
    owned = record(OWNER, value=big)
    assert not reader.validate(plain)
    assert not reader.validate(
        dataclasses.replace(owned, value=OwnerValidator(OWNER).sign_value(owned))
    )
    assert refusals.snapshot()["dht_record_too_large"] == 2
    largest_heartbeat = record(OWNER, value=b"x" * (16 * 1024 + 72))
    assert reader.validate(
        dataclasses.replace(
            largest_heartbeat, value=OwnerValidator(OWNER).sign_value(largest_heartbeat)
        )
    )
