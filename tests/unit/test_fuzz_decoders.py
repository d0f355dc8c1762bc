"""Fuzzing of the decoders tests/unit/test_messages.py and test_heartbeat.py leave out.

Each takes untrusted peer input: a repair summary, a request on a stream, a state stream's
manifest and tree, a DHT record (owner-protected or not), an announcement's subkey, a header
whose JSON an attacker chose and signed, a payload any codec decodes in place, and a whole
signed update submitted to the merge pipeline. Arbitrary or mutated input raises only the
project's own validation error (or, for the pipeline, is a counted rejection, never an
exception).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import struct
from typing import Any

import pytest
import torch
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht.gossip_serve import parse_update_request
from dht.messages import MessageError, parse_announced_seq, parse_run_listing
from dht.ranges import parse_ranges
from dht.records import _OWNER_RE, OwnerValidator, owner_subkey
from dht.tensor_stream import join_tensors, parse_spec
from dht.transport import TransportError, decode_request
from merge.codecs import CODECS, CodecError, get_codec
from merge.envelope import MAX_CREATED_AT, EnvelopeError, SignedHeader, SignedUpdate
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.weighting import TokenWeightConfig
from tests.factories import MALLORY, identity, sealed_update

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OWNER = identity("o")
FINGERPRINT = hashlib.sha256(b"fuzz").hexdigest()
NUMEL = 16
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def mutate(data: bytes, draw: st.DataObject) -> bytes:
    index = draw.draw(st.integers(0, len(data) - 1))
    return data[:index] + draw.draw(st.binary(max_size=6)) + data[index + 1 :]


# ---- repair summaries and stream requests ---------------------------------------------------


@FAST
@given(JSON)
def test_summaries_of_any_json_raise_only_value_errors(value: Any) -> None:
    try:
        ranges = parse_ranges(value, max_ids=1000)
    except ValueError:
        return
    assert sum(hi - lo + 1 for runs in ranges.values() for lo, hi in runs) <= 1000


def test_a_summary_naming_a_huge_range_is_refused_before_it_is_walked() -> None:
    with pytest.raises(ValueError, match="more than"):
        parse_ranges({"a": [[0, 10**15]]}, max_ids=1 << 20)


@FAST
@given(st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()))
def test_stream_requests_raise_only_transport_errors(blob: bytes) -> None:
    with contextlib.suppress(TransportError):
        assert isinstance(decode_request(blob), dict)


# ---- state streams ------------------------------------------------------------------------


@FAST
@given(JSON)
def test_tensor_specs_raise_only_value_errors(spec: Any) -> None:
    with contextlib.suppress(ValueError):
        parsed = parse_spec(spec)
        assert len(parsed.shape) <= 8 and parsed.nbytes >= 0


@FAST
@given(JSON, st.integers(0, 3))
def test_state_trees_raise_only_value_errors(tree: Any, num_tensors: int) -> None:
    tensors = [torch.zeros(2) for _ in range(num_tensors)]
    with contextlib.suppress(ValueError):
        join_tensors(tree, tensors)


def test_a_state_tree_naming_a_tensor_it_did_not_send_is_refused() -> None:
    for index in (1, -1, True, "0", 1.0):
        with pytest.raises(ValueError):
            join_tensors({"params": {"__tensor__": index}}, [torch.zeros(1)])


# ---- DHT records --------------------------------------------------------------------------


def _record(subkey: bytes, value: bytes, expiration: float = 100.0) -> DHTRecord:
    return DHTRecord(key=b"diloco/x/peers", subkey=subkey, value=value, expiration_time=expiration)


@FAST
@given(st.binary(max_size=200), st.binary(max_size=200))
def test_the_owner_validator_answers_any_record_with_a_bool(subkey: bytes, value: bytes) -> None:
    validator = OwnerValidator()
    assert validator.validate(_record(subkey, value)) in (True, False)
    assert isinstance(validator.strip_value(_record(subkey, value)), bytes)


@FAST
@given(st.data())
def test_a_mutated_owner_record_is_refused(data: st.DataObject) -> None:
    """Whatever an attacker changes in a signed heartbeat record (subkey, value, signature,
    expiration), no validator accepts it as an owner record any more (a subkey mutated out of
    the `[owner:...]` form is an ordinary, unprotected record)."""
    subkey = MSGPackSerializer.dumps(owner_subkey(OWNER.peer_id))  # as hivemind serializes it
    signer = OwnerValidator(OWNER)
    record = _record(subkey, b"heartbeat")
    signed = dataclasses.replace(record, value=signer.sign_value(record))
    assert OwnerValidator().validate(signed)
    part = data.draw(st.sampled_from(["subkey", "value", "expiration"]))
    if part == "expiration":
        forged = dataclasses.replace(signed, expiration_time=data.draw(st.floats(101, 1e12)))
    else:
        forged = dataclasses.replace(signed, **{part: mutate(getattr(signed, part), data)})
    if forged != signed and OwnerValidator().validate(forged):
        assert not _OWNER_RE.search(forged.subkey), "a changed owner record was accepted"


@FAST
@given(JSON | st.binary(max_size=20))
def test_announcement_subkeys_and_run_listings_raise_only_message_errors(subkey: Any) -> None:
    with contextlib.suppress(MessageError):
        assert parse_announced_seq(subkey, "12D3KooWauthor") >= 1
    with contextlib.suppress(MessageError):
        assert parse_run_listing(subkey).isprintable()


# ---- headers whose JSON the attacker chose and signed ---------------------------------------


def _signed_header_blob(fields: dict[str, Any]) -> bytes:
    raw = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    return b"DLH1" + struct.pack("<I", len(raw)) + raw + MALLORY.sign(raw)


VALID_HEADER = sealed_update(
    MALLORY, fingerprint=FINGERPRINT, seq=1, inner_steps=1, tokens=1, loss=1.0, numel=NUMEL
).header.to_dict()


@FAST
@given(st.dictionaries(st.sampled_from(sorted(VALID_HEADER)), JSON, max_size=4))
def test_signed_headers_with_any_field_values_raise_only_envelope_errors(
    changes: dict[str, Any],
) -> None:
    with contextlib.suppress(EnvelopeError):
        signed = SignedHeader.from_bytes(_signed_header_blob(VALID_HEADER | changes))
        assert (
            signed.header.canonical_bytes()
            == json.dumps(
                VALID_HEADER | changes, sort_keys=True, separators=(",", ":"), ensure_ascii=True
            ).encode()
        )


# ---- payloads and whole updates -------------------------------------------------------------


@FAST
@given(st.sampled_from(sorted(CODECS)), st.binary(max_size=256), st.integers(-5, 300))
def test_codecs_decode_arbitrary_bytes_in_place_or_raise_codec_errors(
    name: str, payload: bytes, numel: int
) -> None:
    try:
        decoded = get_codec(name).decode_view(payload, numel)
    except CodecError:
        return
    assert decoded.shape == (numel,) and decoded.dtype == torch.float32


def _pipeline() -> UpdatePipeline:
    config = MergeConfig(
        outer=OuterConfig(kind="nesterov", lr=0.5, momentum=0.5),
        token_weight=TokenWeightConfig(reference_tokens=100),
        max_inner_steps=100,
        max_tokens_per_step=100,
    )
    replica = Replica(torch.ones(NUMEL), make_outer_optimizer(config.outer, NUMEL))
    return UpdatePipeline(replica, config, FINGERPRINT)


@FAST
@given(
    codec=st.sampled_from(sorted(CODECS)),
    numel=st.sampled_from([NUMEL, NUMEL - 1, NUMEL + 1, 0]),
    payload=st.binary(max_size=4 * NUMEL + 16)
    | st.lists(
        st.floats(width=32) | st.sampled_from([float("nan"), float("inf"), 1e30]),
        min_size=NUMEL,
        max_size=NUMEL,
    ).map(lambda xs: get_codec("fp32").encode(torch.tensor(xs, dtype=torch.float32))),
    seq=st.integers(0, 2**63 - 1),
    created_at=st.floats(0, MAX_CREATED_AT),
)
def test_any_signed_update_is_merged_or_rejected_with_a_reason_never_raised(
    codec: str, numel: int, payload: bytes, seq: int, created_at: float
) -> None:
    pipeline = _pipeline()
    before = pipeline.replica.params.clone()
    update = sealed_update(
        MALLORY, payload=payload, codec=codec, numel=numel, fingerprint=FINGERPRINT, seq=seq,
        inner_steps=1, tokens=1, loss=1.0, created_at=created_at,
    )  # fmt: skip
    result = pipeline.submit(SignedUpdate.from_bytes(update.to_bytes()))
    params = pipeline.replica.params
    assert bool(torch.isfinite(params).all())
    if result.accepted:
        assert pipeline.replica.has_applied(MALLORY.peer_id, seq)
    else:
        assert result.reason and pipeline.rejections[result.reason] == 1
        assert torch.equal(params, before)


# ---- numbers from peers: finite and bounded, or refused -------------------------------------

HOSTILE_NUMBERS = [10**400, -(10**400), 2**64, 1e300, -1e300]
NON_FINITE = [float("nan"), float("inf"), float("-inf")]


def _raw_header_blob(fields: dict[str, Any]) -> bytes:
    """Like _signed_header_blob, but NaN and Infinity are written as Python's json writes them."""
    raw = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()
    return b"DLH1" + struct.pack("<I", len(raw)) + raw + MALLORY.sign(raw)


@pytest.mark.parametrize(
    ("name", "value"),
    [("loss", v) for v in HOSTILE_NUMBERS]
    + [("created_at", v) for v in HOSTILE_NUMBERS + NON_FINITE],
)
def test_a_header_number_out_of_its_bounds_is_refused(name: str, value: Any) -> None:
    with pytest.raises(EnvelopeError, match="malformed"):
        SignedHeader.from_bytes(_raw_header_blob(VALID_HEADER | {name: value}))


@pytest.mark.parametrize("loss", NON_FINITE)
def test_a_non_finite_loss_is_refused_by_the_pipeline_and_counted(loss: float) -> None:
    pipeline = _pipeline()
    update = sealed_update(
        MALLORY, fingerprint=FINGERPRINT, seq=1, inner_steps=1, tokens=1, loss=loss, numel=NUMEL
    )
    result = pipeline.submit(SignedUpdate.from_bytes(update.to_bytes()))
    assert not result.accepted and pipeline.rejections["non_finite"] == 1


def test_a_negative_creation_time_is_refused_and_a_huge_loss_is_sealed_within_bounds() -> None:
    with pytest.raises(EnvelopeError, match="created_at"):
        SignedHeader.from_bytes(_raw_header_blob(VALID_HEADER | {"created_at": -1.0}))
    update = sealed_update(
        MALLORY, fingerprint=FINGERPRINT, seq=1, inner_steps=1, tokens=1, loss=1e300, numel=NUMEL
    )
    assert SignedHeader.from_bytes(update.signed_header.to_bytes()).header.loss == 1e6


@FAST
@given(
    st.sampled_from(["loss", "created_at"]),
    st.floats(allow_nan=True, allow_infinity=True) | st.integers(),
)
def test_a_header_number_is_refused_or_parses_finite(name: str, value: Any) -> None:
    try:
        header = SignedHeader.from_bytes(_raw_header_blob(VALID_HEADER | {name: value})).header
    except EnvelopeError:
        return
    parsed = getattr(header, name)
    if name == "created_at":
        assert math.isfinite(parsed) and 0 <= parsed <= MAX_CREATED_AT
    else:  # a non-finite float loss is the pipeline's to refuse (tested above)
        assert type(parsed) is float and not math.isfinite(parsed) or abs(parsed) <= 1e6


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_request_holding_nan_or_infinity_is_refused(constant: bytes) -> None:
    with pytest.raises(TransportError):
        decode_request(b'{"args": ["a", ' + constant + b"]}")


def test_a_deeply_nested_request_is_refused_not_raised() -> None:
    with pytest.raises(TransportError):
        decode_request(b"[" * 200_000)


@FAST
@given(JSON)
def test_update_requests_parse_to_a_bounded_id_or_raise_transport_errors(args: Any) -> None:
    try:
        author, seq = parse_update_request(args)
    except TransportError:
        return
    assert 0 < len(author) <= 128 and 1 <= seq <= 2**53
