"""Heartbeats are strict models: whatever a peer signs, only HeartbeatError comes out."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht.heartbeat import MAGIC, Heartbeat, HeartbeatError, sign_fields
from merge.identity import Identity

IDENTITY = Identity.generate()
PEER = IDENTITY.peer_id
FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
JSON_VALUES = (
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    | st.lists(st.integers() | st.floats() | st.text(max_size=4), max_size=4)
    | st.dictionaries(st.text(max_size=8), st.integers() | st.none(), max_size=4)
)  # fmt: skip


def honest(**fields: Any) -> Heartbeat:
    return Heartbeat(peer_id=PEER, sent_at=1e9, applied_digest="ab" * 32, **fields)


def signed_body(**changes: Any) -> bytes:
    return sign_fields(dataclasses.asdict(honest()) | changes, IDENTITY)


def test_an_honest_heartbeat_round_trips() -> None:
    beat = honest(loss=2.5, sketch=[0.5, -1.0], rejections={"replay": 3})
    assert Heartbeat.verify(beat.sign(IDENTITY), PEER) == beat


@pytest.mark.parametrize(
    "changes",
    [
        {"sketch": None},  # broke membership polling
        {"applied_digest": ["a", "b"]},  # raised inside the learner's round (drift)
        {"sent_at": "tomorrow"},  # broke the comparison of heartbeats
        {"loss": 10**400},  # OverflowError in background tasks
        {"val_loss": 1e308},  # two of them overflowed the mean: /api/swarm answered 500
        {"round": True},
        {"num_applied": 2**64},
        {"state": "hacking"},
        {"org": "x" * 65},
        {"maddrs": ["/ip4/1.2.3.4/tcp/1"] * 17},
        {"unknown_field": 1},
        {"sketch": [float("nan")]},
        {"rejected_peers": {"p": {"replay": -1}}},
        {"rejected_peers": {f"p{i}": {} for i in range(9)}},
        {"paths": {"carrier-pigeon": 1}},  # only the three paths a node measures
        {"paths": {"relayed": -1}},
        {"paths": {"direct": "2"}},
        {"paths": [1, 0, 2]},
        {"codec": "TOPK"},  # a codec's name: lower-case letters, digits, _, at most 16
        {"codec": "x" * 17},
        {"codec": ""},
        {"codec": "<b>topk</b>"},
        {"codec": "topk\n"},
        {"codec": 3},
        {"codec_auto": "yes"},
        {"codec_auto": 1},
        {"uplink_bytes_per_s": -1.0},
        {"uplink_bytes_per_s": 1e13},  # past MAX_UPLINK
        {"uplink_bytes_per_s": "625 KB/s"},
        {"uplink_bytes_per_s": float("inf")},
        {"uplink_bytes_per_s": float("nan")},
    ],
)
def test_mistyped_or_out_of_range_fields_are_rejected(changes: dict[str, Any]) -> None:
    with pytest.raises(HeartbeatError) as raised:
        Heartbeat.verify(signed_body(**changes), PEER)
    assert raised.value.reason == "malformed"


def test_a_heartbeat_signed_by_another_key_is_rejected() -> None:
    other = Identity.generate()
    blob = sign_fields(dataclasses.asdict(honest()), other)
    with pytest.raises(HeartbeatError) as raised:
        Heartbeat.verify(blob, PEER)
    assert raised.value.reason == "bad_signature"


def test_a_heartbeat_naming_another_peer_is_rejected() -> None:
    other = Identity.generate()
    blob = sign_fields(dataclasses.asdict(honest()), other)  # claims PEER, signed by other
    with pytest.raises(HeartbeatError) as raised:
        Heartbeat.verify(blob, other.peer_id)
    assert raised.value.reason == "wrong_peer"


def test_a_node_cannot_build_a_heartbeat_its_peers_would_refuse() -> None:
    with pytest.raises(ValueError):
        honest(loss=float("inf"))


def test_an_oversized_body_is_refused_before_it_is_read() -> None:
    blob = MAGIC + (1 << 30).to_bytes(4, "big") + b"{}"
    with pytest.raises(HeartbeatError) as raised:
        Heartbeat.verify(blob, PEER)
    assert raised.value.reason == "too_large"


@FAST
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_heartbeat_errors(blob: bytes) -> None:
    with pytest.raises(HeartbeatError):
        Heartbeat.verify(blob, PEER)


@FAST
@given(st.data())
def test_mutated_signed_bodies_raise_only_heartbeat_errors(data: st.DataObject) -> None:
    """The attacker signs whatever it mutated: the parser, not the signature, must stop it."""
    body = json.dumps(dataclasses.asdict(honest(sketch=[1.0]))).encode()
    index = data.draw(st.integers(0, len(body) - 1))
    mutated = body[:index] + data.draw(st.binary(min_size=0, max_size=8)) + body[index + 1 :]
    blob = MAGIC + len(mutated).to_bytes(4, "big") + mutated + IDENTITY.sign(mutated)
    try:
        beat = Heartbeat.verify(blob, PEER)
    except HeartbeatError:
        return
    assert beat.peer_id == PEER  # a mutation that stays valid still parses into a valid model


@FAST
@given(
    st.dictionaries(st.sampled_from([f.name for f in dataclasses.fields(Heartbeat)]), JSON_VALUES)
)
def test_any_json_values_raise_only_heartbeat_errors(changes: dict[str, Any]) -> None:
    with contextlib.suppress(HeartbeatError):
        Heartbeat.verify(signed_body(**changes), PEER)


def test_a_heartbeat_of_the_previous_version_without_paths_still_parses() -> None:
    fields = dataclasses.asdict(honest())
    del fields["paths"]
    beat = Heartbeat.verify(sign_fields(fields, IDENTITY), PEER)
    assert beat.paths == {}


def test_path_counts_round_trip() -> None:
    beat = honest(paths={"direct": 1, "holepunched": 0, "relayed": 2})
    assert Heartbeat.verify(beat.sign(IDENTITY), PEER).paths == beat.paths


def test_the_codec_and_the_uplink_round_trip() -> None:
    beat = honest(codec="topk", codec_auto=True, uplink_bytes_per_s=625000.0)
    assert Heartbeat.verify(beat.sign(IDENTITY), PEER) == beat


def test_a_codec_this_node_does_not_know_parses_as_sent() -> None:
    """A later version's codec: still a bounded name, shown as sent (not a malformed peer)."""
    beat = honest(codec="dct_topk2", codec_auto=False)
    assert Heartbeat.verify(beat.sign(IDENTITY), PEER).codec == "dct_topk2"


def test_a_heartbeat_without_the_codec_fields_parses_and_signs_the_bytes_of_before() -> None:
    """An earlier version's heartbeat (none of the three) verifies with them unknown (None);
    and a heartbeat without them sends no key for them, so earlier versions' strict parsers
    (extra="forbid") accept it."""
    fields = dataclasses.asdict(honest())
    for name in ("codec", "codec_auto", "uplink_bytes_per_s"):
        del fields[name]
    beat = Heartbeat.verify(sign_fields(fields, IDENTITY), PEER)
    assert (beat.codec, beat.codec_auto, beat.uplink_bytes_per_s) == (None, None, None)
    body = json.loads(honest().sign(IDENTITY)[8:-64])
    assert not {"codec", "codec_auto", "uplink_bytes_per_s"} & set(body)


def test_a_node_cannot_build_a_heartbeat_with_a_codec_its_peers_would_refuse() -> None:
    for bad in ({"codec": "Top K"}, {"uplink_bytes_per_s": -5.0}, {"uplink_bytes_per_s": 1e13}):
        with pytest.raises(ValueError):
            honest(**bad)
