"""Every decoder of peer input raises only the project's own error, whatever the bytes.

Property-based (hypothesis): arbitrary bytes, and valid messages with bytes mutated, through
the envelope, the header parser, the codecs, DHT records and the state manifest.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from hivemind.utils import MSGPackSerializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht.messages import (
    MAX_HOLDER_RANGES,
    MAX_SEQ,
    MessageError,
    announcement_subkey,
    holder_ranges,
    holder_subkey,
    parse_announced_seq,
    parse_holder,
    parse_run_record,
    parse_signed_header,
    parse_state_manifest,
)
from dht.records import MAX_VALUE_BYTES
from merge.codecs import CODECS, CodecError, get_codec
from merge.envelope import EnvelopeError, SignedUpdate
from merge.identity import Identity
from tests.factories import FINGERPRINT, sealed_update

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ALICE, MALLORY = Identity.generate(), Identity.generate()
PAYLOAD = get_codec("fp32").encode(torch.arange(8, dtype=torch.float32))


def sealed(identity: Identity = ALICE, seq: int = 3) -> SignedUpdate:
    """The same bytes on every call (hypothesis replays its examples)."""
    return sealed_update(
        identity, seq=seq, published_applied=1, inner_steps=1, tokens=10, loss=1.0, payload=PAYLOAD
    )


def mutate(data: bytes, draw: st.DataObject) -> bytes:
    index = draw.draw(st.integers(0, len(data) - 1))
    return data[:index] + draw.draw(st.binary(max_size=6)) + data[index + 1 :]


def test_a_signed_header_parses_and_is_bound_to_its_key() -> None:
    blob = sealed().signed_header.to_bytes()
    assert parse_signed_header(blob, author=ALICE.peer_id, seq=3).header.seq == 3
    with pytest.raises(MessageError) as raised:
        parse_signed_header(blob, author=MALLORY.peer_id)
    assert raised.value.reason == "wrong_author"


def test_a_header_in_another_authors_name_is_refused_before_anything_stores_it() -> None:
    forged = sealed(MALLORY)
    header = forged.header.__class__(**{**forged.header.__dict__, "author": ALICE.peer_id})
    blob = type(forged.signed_header)(header, forged.signature).to_bytes()
    with pytest.raises(MessageError) as raised:
        parse_signed_header(blob)
    assert raised.value.reason == "bad_signature"


def test_an_oversized_header_is_refused_before_it_is_parsed() -> None:
    with pytest.raises(MessageError) as raised:
        parse_signed_header(b"DLH1" + bytes(10_000))
    assert raised.value.reason == "too_large"


@FAST
@given(st.binary(max_size=600))
def test_arbitrary_bytes_as_a_header(blob: bytes) -> None:
    with pytest.raises(MessageError):
        parse_signed_header(blob)


@FAST
@given(st.data())
def test_mutated_headers_raise_only_message_errors(data: st.DataObject) -> None:
    blob = mutate(sealed().signed_header.to_bytes(), data)
    with contextlib.suppress(MessageError):
        parse_signed_header(blob)


@FAST
@given(st.data())
def test_mutated_envelopes_raise_only_envelope_errors(data: st.DataObject) -> None:
    blob = mutate(sealed().to_bytes(), data)
    with contextlib.suppress(EnvelopeError):
        SignedUpdate.from_bytes(blob)


@FAST
@given(st.sampled_from(sorted(CODECS)), st.binary(max_size=256), st.integers(-5, 300))
def test_codecs_decode_arbitrary_bytes_or_raise_codec_errors(
    name: str, payload: bytes, numel: int
) -> None:
    try:
        decoded = get_codec(name).decode(payload, numel)
    except CodecError:
        return
    assert decoded.shape == (numel,) and decoded.dtype == torch.float32


def test_an_unknown_codec_is_a_codec_error() -> None:
    with pytest.raises(CodecError):
        get_codec("int3")


_RANGE_ENDS = st.integers(min_value=-2, max_value=2**54) | st.booleans() | st.text(max_size=3)


@FAST
@given(
    st.text(max_size=200)
    | st.integers()
    | st.none()
    | st.builds(lambda s: f"[owner:{ALICE.peer_id}]{s}", st.text(max_size=30))
    | st.just(holder_subkey(ALICE.peer_id)),
    st.booleans()
    | st.text(max_size=5)
    | st.lists(
        st.lists(_RANGE_ENDS, max_size=3) | st.tuples(_RANGE_ENDS, _RANGE_ENDS), max_size=20
    ),
)
def test_holder_records_raise_only_message_errors(subkey: object, value: object) -> None:
    try:
        record = parse_holder(subkey, value)
    except MessageError:
        return
    assert record.holder == ALICE.peer_id and 1 <= len(record.ranges) <= MAX_HOLDER_RANGES
    ends = [end for pair in record.ranges for end in pair]
    assert ends == sorted(ends) and ends[0] >= 1 and ends[-1] <= MAX_SEQ
    assert all(lo <= hi for lo, hi in record.ranges)


def test_a_holder_record_names_its_owner_as_the_holder() -> None:
    record = parse_holder(holder_subkey(ALICE.peer_id), [[3, 5], [7, 7]])
    assert (record.holder, record.ranges) == (ALICE.peer_id, ((3, 5), (7, 7)))
    older = parse_holder(f"[owner:{ALICE.peer_id}]7", True)  # one seq a subkey, still read
    assert (older.holder, older.ranges) == (ALICE.peer_id, ((7, 7),))
    subkey = holder_subkey(ALICE.peer_id)
    for junk in (f"7:{ALICE.peer_id}", 7, f"[owner:{ALICE.peer_id}]x", f"[owner:{ALICE.peer_id}]0"):
        with pytest.raises(MessageError, match="malformed"):
            parse_holder(junk, True)
    for value in (True, [], [[5, 3]], [[1, 4], [4, 6]], [[2, 2], [1, 1]], [[True, 2]], [[0, 1]]):
        with pytest.raises(MessageError, match="malformed"):
            parse_holder(subkey, value)
    with pytest.raises(MessageError, match="malformed"):
        parse_holder(subkey, [[2 * s, 2 * s] for s in range(1, MAX_HOLDER_RANGES + 2)])


@FAST
@given(st.sets(st.integers(min_value=1, max_value=10_000), max_size=500))
def test_a_holder_names_its_newest_retained_seqs_in_one_bounded_value(seqs: set[int]) -> None:
    """However many updates of one author a node retains (a flood), its holder record is one
    subkey whose value names their newest ranges, reads back as it was written, and fits a
    DHT value: the record grows with holders, never with updates."""
    value = holder_ranges(seqs)
    assert len(value) <= MAX_HOLDER_RANGES
    assert len(MSGPackSerializer.dumps(value)) <= MAX_VALUE_BYTES // 32
    if not seqs:
        assert value == []
        return
    record = parse_holder(holder_subkey(ALICE.peer_id), value)
    named = {seq for lo, hi in record.ranges for seq in range(lo, hi + 1)}
    assert named <= seqs and max(seqs) in named
    assert all(seq in named for seq in seqs if seq >= record.ranges[0][0]), "newest, no gaps"


def test_an_announcement_subkey_must_belong_to_its_author() -> None:
    mallory = MALLORY.peer_id
    assert parse_announced_seq(announcement_subkey(ALICE.peer_id, 12), ALICE.peer_id) == 12
    with pytest.raises(MessageError, match="wrong_author"):
        parse_announced_seq(announcement_subkey(mallory, 12), ALICE.peer_id)
    with pytest.raises(MessageError, match="malformed"):
        parse_announced_seq(12, ALICE.peer_id)  # the old int subkeys


@FAST
@given(st.text(max_size=80) | st.integers(), st.text(max_size=300) | st.binary(max_size=30))
def test_run_records_raise_only_message_errors(subkey: object, value: object) -> None:
    with contextlib.suppress(MessageError):
        parse_run_record(subkey, value)


def test_a_run_record_parses_and_huge_ones_are_refused() -> None:
    record = parse_run_record(FINGERPRINT, json.dumps({"model": "tiny", "seed": 0}))
    assert record.summary["model"] == "tiny"
    with pytest.raises(MessageError):
        parse_run_record(FINGERPRINT, json.dumps({"x": "y" * 5000}))


MANIFEST = json.dumps(
    {"tree": {"params": {"__tensor__": 0}, "num_applied": 3},
     "tensors": [{"dtype": "float32", "shape": [8]}]}
).encode()  # fmt: skip


def test_a_state_manifest_is_sized_before_any_tensor_is_read() -> None:
    assert parse_state_manifest(MANIFEST, max_state_bytes=1024).num_bytes == 32
    huge = json.dumps({"tree": {}, "tensors": [{"dtype": "float32", "shape": [1 << 39, 4]}]})
    with pytest.raises(MessageError) as raised:
        parse_state_manifest(huge.encode(), max_state_bytes=1 << 30)
    assert raised.value.reason == "too_large"


@FAST
@given(st.data())
def test_mutated_state_manifests_raise_only_message_errors(data: st.DataObject) -> None:
    with contextlib.suppress(MessageError):
        parse_state_manifest(mutate(MANIFEST, data), max_state_bytes=1 << 20)


@FAST
@given(st.binary(max_size=300))
def test_arbitrary_bytes_as_a_state_manifest(blob: bytes) -> None:
    with pytest.raises(MessageError):
        parse_state_manifest(blob, max_state_bytes=1 << 20)


def test_a_listed_run_id_is_a_short_printable_string() -> None:
    from dashboard.standalone import choose_run
    from dht.messages import parse_run_listing

    assert parse_run_listing("diloco-default") == "diloco-default"
    for junk in (7, None, "", "x" * 65, "a\x00b"):
        with pytest.raises(MessageError):
            parse_run_listing(junk)
    assert choose_run([]) == "diloco-default"  # nothing trains yet: the default run
    assert choose_run(["lab-run"]) == "lab-run"
    with pytest.raises(ValueError, match="choose one with --run-id"):
        choose_run(["a", "b"])


def test_a_run_record_with_the_non_default_settings_parses() -> None:
    """Nodes publish their non-default fingerprint settings nested in the run record; a strict
    parser that refused them made `status` and the dashboard find no run at all."""
    import json

    from dht.messages import parse_run_record

    settings = {"run_id": "lab", "model": "tiny", "inner_steps": 10, "outer_lr": 0.5}
    summary = {"model": "tiny", "seed": 0, "outer": "delayed_nesterov", "settings": settings}
    record = parse_run_record("ab" * 32, json.dumps(summary))
    assert record.summary == summary
    with pytest.raises(MessageError):
        parse_run_record("ab" * 32, json.dumps({"settings": {"deeper": {"x": 1}}}))
