"""Heartbeat records only their owner can write, on real hivemind DHT members (loopback).

Before: one DHT write per victim, with a later expiration, replaced the victim's heartbeat
and two honest nodes dropped each other. With OwnerValidator on every honest member, a
foreign write is refused on store and on read, and the owner's newest record wins.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
from hivemind import DHT
from hivemind.utils import MSGPackSerializer, get_dht_time

from dht.records import OwnerValidator, RefusalCounts, owner_subkey, subkey_owner
from merge.identity import Identity

pytestmark = [pytest.mark.swarm, pytest.mark.beside]  # light: runs beside the swarm tests
KEY = "diloco/test/peers"


@pytest.fixture
def members() -> Iterator[list[DHT]]:
    started: list[DHT] = []
    try:
        yield started
    finally:
        for dht in started:
            dht.shutdown()


def test_a_foreign_or_far_future_write_never_hides_a_peers_heartbeat(members: list[DHT]) -> None:
    victim, mallory = Identity.generate(), Identity.generate()
    owner = DHT(start=True, record_validators=[OwnerValidator(victim)])
    members.append(owner)
    peers = [str(m) for m in owner.get_visible_maddrs()]
    reader = DHT(initial_peers=peers, start=True, record_validators=[OwnerValidator()])
    members.append(reader)
    attacker = DHT(initial_peers=peers, start=True)  # runs no validator: stores anything
    members.append(attacker)
    subkey = owner_subkey(victim.peer_id)
    assert subkey_owner(subkey) == victim.peer_id

    owner.store(KEY, b"heartbeat-1", get_dht_time() + 30, subkey=subkey)
    attacker.store(KEY, b"overwritten", get_dht_time() + 10**6, subkey=subkey)
    attacker.store(KEY, b"forged", get_dht_time() + 10**6, subkey=owner_subkey(mallory.peer_id))
    seen = reader.get(KEY, latest=True)
    assert seen is not None and seen.value[subkey].value == b"heartbeat-1"

    owner.store(KEY, b"heartbeat-2", get_dht_time() + 30, subkey=subkey)
    seen = reader.get(KEY, latest=True)
    assert seen is not None and seen.value[subkey].value == b"heartbeat-2"


def test_the_records_a_member_refuses_are_counted_in_the_nodes_process(
    members: list[DHT],
) -> None:
    """hivemind validates in the DHT's own (forked) process: the counts reach the node."""
    victim = Identity.generate()
    refusals = RefusalCounts()
    honest = DHT(start=True, record_validators=[OwnerValidator(victim, refusals)])
    members.append(honest)
    peers = [str(m) for m in honest.get_visible_maddrs()]
    attacker = DHT(initial_peers=peers, start=True)  # runs no validator: stores anything
    members.append(attacker)
    subkey = owner_subkey(victim.peer_id)
    honest.store(KEY, b"heartbeat", get_dht_time() + 30, subkey=subkey)
    assert refusals.snapshot() == dict.fromkeys(refusals.snapshot(), 0)  # honest: none

    junk = b"overwritten[ed25519]" + bytes(64)  # a signature that does not verify
    attacker.store(KEY, junk, get_dht_time() + 10**6, subkey=subkey)
    attacker.store(KEY, b"overwritten", get_dht_time() + 10**6, subkey=subkey)  # none at all
    attacker.store(KEY, b"plain", get_dht_time() + 10**6, subkey=12345)
    counted = refusals.snapshot()
    assert counted["dht_record_bad_signature"] >= 1, counted
    assert counted["dht_record_unsigned"] >= 1, counted
    assert counted["dht_record_subkey"] >= 1, counted
    seen = honest.get(KEY, latest=True)
    assert seen is not None and seen.value[subkey].value == b"heartbeat"


async def _raw_store(
    _dht: DHT, node: Any, key: str, subkey: object, value: bytes, expiration: float
) -> list[list[bool] | None]:
    """Store straight into every known member's storage, as a patched client would."""
    from hivemind.dht.routing import DHTID

    payload = MSGPackSerializer.dumps(value)
    stored = []
    for peer in list(node.protocol.routing_table.peer_id_to_uid):
        ok = await node.protocol.call_store(
            peer, [DHTID.generate(source=key)], [payload], expiration, subkeys=[subkey]
        )
        stored.append(None if ok is None else list(ok))
    return stored


def test_a_plain_value_or_a_mixed_type_subkey_never_breaks_a_record(members: list[DHT]) -> None:
    """Before: a str subkey stored with the same expiration as an int one made hivemind's
    storage raise TypeError on the key (its expiration heap compares (expiration, subkey));
    a plain value with a later expiration replaced the whole dictionary. Both are refused."""
    owner = Identity.generate()
    honest = DHT(start=True, record_validators=[OwnerValidator(owner)])
    members.append(honest)
    peers = [str(m) for m in honest.get_visible_maddrs()]
    reader = DHT(initial_peers=peers, start=True, record_validators=[OwnerValidator()])
    members.append(reader)
    attacker = DHT(initial_peers=peers, start=True)
    members.append(attacker)
    subkey = owner_subkey(owner.peer_id, "7")

    assert honest.store(KEY, b"announcement", get_dht_time() + 30, subkey=subkey)
    seen = reader.get(KEY, latest=True)
    assert seen is not None
    expiration = seen.value[subkey].expiration_time
    for junk in (7, b"raw", None, 2.5):
        at = expiration + (10**6 if junk is None else 0)  # plain: a later expiration wins
        stored = attacker.run_coroutine(
            partial(_raw_store, key=KEY, subkey=junk, value=b"junk", expiration=at)
        )
        assert stored == [[False], [False]], junk  # both honest members refuse it
    seen = reader.get(KEY, latest=True)
    assert seen is not None and dict(seen.value) == {subkey: seen.value[subkey]}
    assert seen.value[subkey].value == b"announcement"
    later = owner_subkey(owner.peer_id, "8")
    assert honest.store(KEY, b"next", get_dht_time() + 30, subkey=later)
    seen = reader.get(KEY, latest=True)
    assert seen is not None and set(seen.value) == {subkey, later}


def test_status_and_dashboard_find_the_runs_a_swarm_trains(members: list[DHT]) -> None:
    """Without --run-id, `status` lists what the DHT's run listing names; junk is skipped."""
    from dht.messages import RUN_LISTING_KEY
    from dht.observer import SwarmObserver

    node = DHT(start=True, record_validators=[OwnerValidator()])
    members.append(node)
    expiry = get_dht_time() + 60
    for subkey in ("alpha", "beta", "x" * 65, "bad\nname"):
        assert node.store(RUN_LISTING_KEY, True, expiry, subkey=subkey)

    with SwarmObserver([str(m) for m in node.get_visible_maddrs()]) as observer:
        assert observer.run_ids() == ["alpha", "beta"]


def test_status_reads_every_heartbeat_shard_and_the_single_key(members: list[DHT]) -> None:
    """The observer walks the shard tree through split marks, and still reads the single key
    of earlier versions: peers in two leaves and one old node are all shown."""
    import json

    from dht.grouping import peer_bits
    from dht.heartbeat import Heartbeat
    from dht.observer import SwarmObserver
    from dht.shard_walk import SPLIT_VALUE, split_subkey
    from dht.shards import shard_key

    run_id, fingerprint = "sharded", "ab" * 32
    prefix = f"diloco/{fingerprint[:16]}"
    ids = [Identity.generate() for _ in range(12)]
    left = next(i for i in ids if peer_bits(run_id, i.peer_id)[0] == "0")
    right = next(i for i in ids if peer_bits(run_id, i.peer_id)[0] == "1")
    old = Identity.generate()
    expiry = get_dht_time() + 60
    for identity, key in (
        (left, shard_key("0")),
        (right, shard_key("1")),
        (old, "peers"),
    ):  # each owner's record, signed by a member holding its key
        writer = DHT(
            initial_peers=[str(m) for m in members[0].get_visible_maddrs()] if members else [],
            start=True,
            record_validators=[OwnerValidator(identity)],
        )
        members.append(writer)
        beat = Heartbeat(peer_id=identity.peer_id, sent_at=get_dht_time()).sign(identity)
        assert writer.store(f"{prefix}/{key}", beat, expiry, subkey=owner_subkey(identity.peer_id))
        if identity is left:  # the root has split: one mark sends readers down
            assert writer.store(
                f"{prefix}/{shard_key('')}", SPLIT_VALUE, expiry, subkey=split_subkey(left.peer_id)
            )
            assert writer.store(
                f"diloco-run/{run_id}", json.dumps({"model": "tiny"}), expiry, subkey=fingerprint
            )

    with SwarmObserver([str(m) for m in members[0].get_visible_maddrs()]) as observer:
        (snapshot,) = observer.snapshot(run_id)
    shown = {p.heartbeat.peer_id for p in snapshot.peers}
    assert shown == {left.peer_id, right.peer_id, old.peer_id}
    assert snapshot.rejected_heartbeats == 0
