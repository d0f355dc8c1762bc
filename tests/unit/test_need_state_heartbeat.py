"""A heartbeat says how many updates its sender waits for a state to bring (`num_need_state`,
session 22's `update_needs_state`): bounded and strict like every count, sent only when not 0,
so a node with nothing waiting signs what peers of the last release accept, byte for byte, and
their heartbeats (without it) parse as 0."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.heartbeat import MAX_COUNT, Heartbeat, HeartbeatError, sign_fields
from dht.records import owner_subkey
from dht.swarm_pages import summarize
from merge.identity import Identity
from tests.unit.test_membership_hold import membership

PEERS = [Identity.from_private_bytes(bytes([i + 7]) * 32) for i in range(3)]
ME = PEERS[0]


def honest(**fields: object) -> Heartbeat:
    return Heartbeat(peer_id=ME.peer_id, sent_at=1e9, num_lost=2, **fields)  # type: ignore[arg-type]


def old_format_fields() -> dict[str, object]:
    """The body a node of the last release signs: every field it knows, none it does not."""
    fields = dataclasses.asdict(honest())
    for name in ("num_need_state", "group_bits", "group_epoch", "codec", "codec_auto"):
        del fields[name]
    del fields["uplink_bytes_per_s"]
    return fields


def test_the_count_round_trips() -> None:
    beat = honest(num_need_state=85)
    assert Heartbeat.verify(beat.sign(ME), ME.peer_id).num_need_state == 85


def test_a_heartbeat_of_the_last_release_parses_with_nothing_waiting() -> None:
    beat = Heartbeat.verify(sign_fields(old_format_fields(), ME), ME.peer_id)
    assert (beat.num_need_state, beat.num_lost) == (0, 2)


def test_nothing_waiting_signs_the_bytes_of_the_last_release() -> None:
    """Its strict parser (extra="forbid") refuses a key it does not know: none is sent at 0."""
    assert honest().sign(ME) == sign_fields(old_format_fields(), ME)
    assert "num_need_state" in json.loads(honest(num_need_state=1).sign(ME)[8:-64])


@pytest.mark.parametrize("value", [-1, MAX_COUNT + 1, "85", True, 1.5, None, [1], {"n": 1}])
def test_a_hostile_count_is_refused_and_counted_by_membership(value: object) -> None:
    """Read as a peer's record arrives: refused as malformed, counted, never raised; the peer
    is not taken as alive on it."""
    fields = dataclasses.asdict(Heartbeat(peer_id=PEERS[1].peer_id, sent_at=1.0))
    blob = sign_fields(fields | {"num_need_state": value}, PEERS[1])
    with pytest.raises(HeartbeatError) as raised:
        Heartbeat.verify(blob, PEERS[1].peer_id)
    assert raised.value.reason == "malformed"
    m = membership(PEERS[2], [{owner_subkey(PEERS[1].peer_id): blob}])
    assert asyncio.run(m.poll()) == [] and not m.is_alive(PEERS[1].peer_id)
    assert m._reject.counts == {"heartbeat_malformed": 1}  # type: ignore[attr-defined]


def test_a_node_cannot_build_a_heartbeat_with_a_count_its_peers_would_refuse() -> None:
    for bad in (-1, MAX_COUNT + 1):
        with pytest.raises(ValueError):
            honest(num_need_state=bad)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, MAX_COUNT), st.integers(0, MAX_COUNT)), max_size=40))
def test_the_summary_sums_every_peers_counts(counts: list[tuple[int, int]]) -> None:
    """What `status` and the dashboard aggregate at any swarm size: the sums over every
    heartbeat read, and how many peers wait for a state at all."""
    beats = [
        Heartbeat(peer_id=f"peer{i}", num_lost=lost, num_need_state=waiting)
        for i, (lost, waiting) in enumerate(counts)
    ]
    s = summarize("run", beats)
    assert s.lost == sum(lost for lost, _ in counts)
    assert s.need_state == sum(waiting for _, waiting in counts)
    assert s.peers_need_state == len([w for _, w in counts if w])
