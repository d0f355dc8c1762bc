"""Heartbeat records only their owner can write, on real hivemind DHT members (loopback).

Before: one DHT write per victim, with a later expiration, replaced the victim's heartbeat
and two honest nodes dropped each other. With OwnerValidator on every honest member, a
foreign write is refused on store and on read, and the owner's newest record wins.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time

from dht.records import OwnerValidator, owner_subkey, subkey_owner
from merge.identity import Identity

pytestmark = pytest.mark.swarm
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
