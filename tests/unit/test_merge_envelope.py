import dataclasses
import hashlib
import json
import random
import struct
from collections.abc import Callable
from functools import partial
from typing import Any

import blake3
import pytest

from merge.envelope import (
    EnvelopeError,
    SignedHeader,
    SignedUpdate,
    UpdateHeader,
    verify,
    verify_header,
)
from merge.identity import Identity
from tests.factories import ALICE, MALLORY, sealed_update


def make_update(
    identity: Identity = ALICE, payload: bytes = b"\x01\x02\x03\x04" * 4
) -> SignedUpdate:
    return sealed_update(
        identity, payload=payload, seq=7, base_applied=10, published_applied=13,
        inner_steps=50, tokens=51200, loss=2.75, created_at=1_700_000_000.5,
    )  # fmt: skip


def reason_of(action: Callable[[], object]) -> str:
    with pytest.raises(EnvelopeError) as excinfo:
        action()
    return excinfo.value.reason


def test_seal_fills_author_hash_and_counters() -> None:
    update = make_update()
    header = update.header

    assert header.author == ALICE.peer_id
    assert header.payload_blake3 == blake3.blake3(update.payload).hexdigest()
    assert header.payload_sha256 is None and header.version == 3
    assert header.staleness == 3
    assert header.update_id == (ALICE.peer_id, 7)
    verify(update)


def test_canonical_bytes_are_sorted_compact_json_with_version() -> None:
    header = make_update().header
    decoded = json.loads(header.canonical_bytes())

    assert decoded["v"] == 3 and decoded["learners"] == 1 and "payload_sha256" not in decoded
    assert list(decoded) == sorted(decoded)
    assert b" " not in header.canonical_bytes()
    assert UpdateHeader.from_dict(decoded) == header
    assert UpdateHeader.from_dict(header.to_dict()).canonical_bytes() == header.canonical_bytes()


def test_signed_update_round_trips_through_bytes() -> None:
    update = make_update()

    parsed = SignedUpdate.from_bytes(update.to_bytes())

    assert parsed == update
    assert update.to_bytes().startswith(b"DLU1")
    verify(parsed)


def test_signed_header_round_trips_and_stays_small() -> None:
    signed = make_update().signed_header
    blob = signed.to_bytes()

    parsed = SignedHeader.from_bytes(blob)

    assert parsed == signed
    assert blob.startswith(b"DLH1") and len(blob) < 1024
    verify_header(parsed)


def test_flipped_payload_byte_is_a_hash_mismatch() -> None:
    blob = bytearray(make_update().to_bytes())
    blob[-1] ^= 0x01

    tampered = SignedUpdate.from_bytes(bytes(blob))

    assert reason_of(lambda: verify(tampered)) == "payload_hash_mismatch"


def test_changed_header_field_breaks_the_signature() -> None:
    update = make_update()
    forged_header = dataclasses.replace(update.header, published_applied=10)  # claims fresh
    forged = SignedUpdate(forged_header, update.signature, update.payload)

    parsed = SignedUpdate.from_bytes(forged.to_bytes())

    assert reason_of(lambda: verify(parsed)) == "bad_signature"


def test_signature_by_another_key_claiming_the_author_is_refused() -> None:
    header = make_update().header  # author is ALICE
    forged = SignedHeader(header, MALLORY.sign(header.canonical_bytes()))

    assert reason_of(lambda: verify_header(forged)) == "bad_signature"


def test_every_truncation_is_malformed() -> None:
    update_blob = make_update().to_bytes()
    header_blob = make_update().signed_header.to_bytes()

    for cut in range(len(header_blob)):
        assert reason_of(partial(SignedHeader.from_bytes, header_blob[:cut])) == "malformed"
        assert reason_of(partial(SignedUpdate.from_bytes, update_blob[:cut])) == "malformed"


def test_any_single_bit_flip_in_a_header_blob_is_caught() -> None:
    blob = make_update().signed_header.to_bytes()

    for position in range(len(blob)):
        flipped = bytearray(blob)
        flipped[position] ^= 0x04
        try:
            verify_header(SignedHeader.from_bytes(bytes(flipped)))
        except EnvelopeError as e:
            assert e.reason in ("malformed", "bad_signature")
        else:
            pytest.fail(f"bit flip at byte {position} went unnoticed")


def test_random_bytes_are_malformed_never_another_error() -> None:
    rng = random.Random(0)
    prefix = b"DLH1" + struct.pack("<I", 40)
    blobs = [rng.randbytes(rng.randrange(0, 600)) for _ in range(200)]
    blobs += [prefix + rng.randbytes(104) for _ in range(50)]
    blobs += [b"DLH1" + struct.pack("<I", 2**32 - 1) + bytes(64), b"DLU1" + struct.pack("<I", 5000)]

    for blob in blobs:
        assert reason_of(partial(SignedHeader.from_bytes, blob)) == "malformed"
        assert reason_of(partial(SignedUpdate.from_bytes, blob)) == "malformed"


@pytest.mark.parametrize("data", [None, "DLH1", 42, [1, 2]])
def test_non_bytes_input_is_malformed(data: object) -> None:
    assert reason_of(lambda: SignedHeader.from_bytes(data)) == "malformed"  # type: ignore[arg-type]


def wrap_header_json(header_json: bytes, signature: bytes = bytes(64)) -> bytes:
    return b"DLH1" + struct.pack("<I", len(header_json)) + header_json + signature


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(seq=True),
        lambda d: d.update(seq=1.0),
        lambda d: d.update(tokens="5"),
        lambda d: d.update(loss="nan"),
        lambda d: d.update(v=4),
        lambda d: d.update(v=2),  # a v2 header binds its payload by SHA-256
        lambda d: d.update(v=1),  # a v1 header has no learners
        lambda d: d.pop("learners"),  # a v2 header has them
        lambda d: d.update(learners=True),
        lambda d: d.update(learners=2.0),
        lambda d: d.update(learners=None),
        lambda d: d.update(learners=2**64),
        lambda d: d.update(extra=1),
        lambda d: d.pop("codec"),
        lambda d: d.update(fingerprint="ab" * 31),
        lambda d: d.update(payload_sha256="0" * 64),  # v3 has BLAKE3 only
        lambda d: d.update(payload_blake3="G" * 64),
        lambda d: d.update(payload_blake3=None),
        lambda d: d.update(author="x" * 129),
        lambda d: d.update(codec="c" * 17),
        lambda d: d.update(numel=2**70),
    ],
)
def test_headers_with_wrong_keys_or_types_are_malformed(
    mutate: Callable[[dict[str, Any]], object],
) -> None:
    d = make_update().header.to_dict()
    mutate(d)
    header_json = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    assert reason_of(lambda: UpdateHeader.from_dict(d)) == "malformed"
    assert reason_of(lambda: SignedHeader.from_bytes(wrap_header_json(header_json))) == "malformed"


def test_non_canonical_json_is_malformed_even_with_a_valid_signature() -> None:
    signed = make_update().signed_header
    spaced = json.dumps(signed.header.to_dict(), sort_keys=True).encode()

    blob = wrap_header_json(spaced, signed.signature)

    assert reason_of(lambda: SignedHeader.from_bytes(blob)) == "malformed"


def test_trailing_bytes_after_a_header_are_malformed() -> None:
    blob = make_update().signed_header.to_bytes() + b"\x00"

    assert reason_of(lambda: SignedHeader.from_bytes(blob)) == "malformed"


def test_non_finite_loss_survives_the_wire_for_the_pipeline_to_reject() -> None:
    update = dataclasses.replace(make_update().header, loss=float("inf"))

    assert SignedHeader.from_bytes(SignedHeader(update, bytes(64)).to_bytes()).header == update


def sha256_header(update: SignedUpdate, version: int) -> UpdateHeader:
    """The update's header as a v1 or v2 author wrote it: payload bound by SHA-256."""
    learners = None if version == 1 else update.header.learners
    sha = hashlib.sha256(update.payload).hexdigest()
    return dataclasses.replace(
        update.header, payload_blake3=None, payload_sha256=sha, learners=learners
    )


@pytest.mark.parametrize("version", [1, 2])
def test_sha256_versions_still_verify_and_catch_a_changed_payload(version: int) -> None:
    update = make_update()
    header = sha256_header(update, version)
    old = SignedUpdate(header, ALICE.sign(header.canonical_bytes()), update.payload)

    parsed = SignedUpdate.from_bytes(old.to_bytes())
    tampered = SignedUpdate(header, old.signature, bytes(len(update.payload)))

    assert parsed == old and parsed.header.version == version
    assert parsed.header.payload_digest == f"sha256:{header.payload_sha256}"
    verify(parsed)
    assert reason_of(lambda: verify(tampered)) == "payload_hash_mismatch"


def test_version_1_headers_stay_valid_and_keep_their_bytes() -> None:
    v1 = sha256_header(make_update(), 1)
    signed = SignedHeader(v1, ALICE.sign(v1.canonical_bytes()))

    parsed = SignedHeader.from_bytes(signed.to_bytes())

    assert json.loads(v1.canonical_bytes())["v"] == 1
    assert "learners" not in json.loads(v1.canonical_bytes())
    assert parsed == signed and parsed.header.version == 1 and parsed.header.learners is None
    verify_header(parsed)


def test_learner_count_is_signed() -> None:
    update = sealed_update(ALICE, seq=1, inner_steps=1, tokens=1, loss=1.0, numel=1, learners=5)
    forged = SignedHeader(dataclasses.replace(update.header, learners=1), update.signature)

    assert SignedHeader.from_bytes(update.signed_header.to_bytes()).header.learners == 5
    verify_header(update.signed_header)
    assert reason_of(lambda: verify_header(forged)) == "bad_signature"
