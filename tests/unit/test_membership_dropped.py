"""A heartbeat record a peer left behind revives nobody once its view is dropped.

bench.attack's sybil_vouchers (flood10): the Sybil vouchers' records, written with a 60 s TTL,
outlived their views (dropped 20 periods after the Sybils fell silent), so each honest node
saw 9 peers "join" for three periods and "leave" every ~20 s until the records expired:
33-37 joins per honest node and run, 2 in a clean run. The DHT is replaced by the records a
read returns (tests/unit/test_membership_hold.py's Reads); tests/swarm prove the wiring.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.heartbeat import Heartbeat
from dht.membership import DroppedPeers, Membership
from dht.records import owner_subkey
from dht.rejections import Rejections
from dht.swarm_config import SwarmConfig
from merge.identity import Identity
from tests.unit.skipped_clock import SkippedClock
from tests.unit.test_membership_hold import Reads, use

PERIOD = 0.01


def membership(me: Identity, events: list[tuple[str, str]]) -> Membership:
    config = SwarmConfig(
        run_id="r", fingerprint="f" * 64, run_summary={}, identity_path="",
        heartbeat_period_s=PERIOD,
    )  # fmt: skip
    return Membership(
        Reads(config, [{}]),  # type: ignore[arg-type]
        me,
        heartbeat_fn=lambda: Heartbeat(peer_id=me.peer_id),
        reject=Rejections(lambda result: None),
        on_event=lambda event, **fields: events.append((event, fields["peer_id"])),
    )


def beat(identity: Identity, sent_at: float) -> dict[str, bytes]:
    blob = Heartbeat(peer_id=identity.peer_id, sent_at=sent_at).sign(identity)
    return {owner_subkey(identity.peer_id): blob}


def poll_until_dropped(
    m: Membership, me: Identity, records: dict[str, bytes], clock: SkippedClock
) -> None:
    """Polls every half period of the test's clock that read `records` beside this node's own
    fresh heartbeat until the views of silent peers were dropped (forget_after_s) and a few
    polls more."""
    for _ in range(round((m.forget_after_s + 8 * PERIOD) / (PERIOD / 2))):
        clock.skip(PERIOD / 2)
        use(m, Reads(m.config, [beat(me, time.time()) | records]))
        asyncio.run(m.poll())


def test_a_record_left_behind_does_not_make_its_peer_join_again(clock: SkippedClock) -> None:
    me, sybil = Identity.generate(), Identity.generate()
    events: list[tuple[str, str]] = []
    m = membership(me, events)
    asyncio.run(m.send_heartbeat())
    left_behind = beat(sybil, time.time())  # written once, read on every poll after
    poll_until_dropped(m, me, left_behind, clock)
    poll_until_dropped(m, me, left_behind, clock)
    assert events.count(("peer_joined", sybil.peer_id)) == 1
    assert events.count(("peer_left", sybil.peer_id)) == 1
    assert not m.is_alive(sybil.peer_id)


def test_a_newer_heartbeat_after_the_drop_is_the_peer_back(clock: SkippedClock) -> None:
    me, peer = Identity.generate(), Identity.generate()
    events: list[tuple[str, str]] = []
    m = membership(me, events)
    asyncio.run(m.send_heartbeat())
    poll_until_dropped(m, me, beat(peer, time.time()), clock)
    assert peer.peer_id not in m.peers
    use(m, Reads(m.config, [beat(me, time.time()) | beat(peer, time.time())]))
    asyncio.run(m.poll())
    assert m.is_alive(peer.peer_id)
    assert events.count(("peer_joined", peer.peer_id)) == 2


@settings(max_examples=300, deadline=None)
@given(
    capacity=st.integers(1, 6),
    steps=st.lists(
        st.tuples(st.sampled_from("abcdefgh"), st.booleans(), st.floats(0, 100)), max_size=40
    ),
)
def test_dropped_peers_refuse_exactly_what_is_no_newer_than_the_drop(
    capacity: int, steps: list[tuple[str, bool, float]]
) -> None:
    """Against a model: a heartbeat is refused exactly when it is no newer than the newest
    dropped one of its peer, while that peer is among the `capacity` most recent drops; the
    bound can forget a drop (the peer may join once more), never invent one."""
    dropped = DroppedPeers(capacity)
    newest: dict[str, float] = {}
    kept: list[str] = []  # the most recent drops, oldest first
    for peer, is_drop, sent_at in steps:
        if is_drop:
            dropped.drop(peer, sent_at)
            newest[peer] = max(sent_at, newest.get(peer, sent_at))
            kept = [p for p in kept if p != peer] + [peer]
            for evicted in kept[:-capacity]:
                del newest[evicted]
            kept = kept[-capacity:]
        else:
            refused = dropped.left_behind(peer, sent_at)
            assert refused == (peer in kept and sent_at <= newest[peer])
            if refused:
                assert sent_at <= newest[peer]  # never refuses a newer heartbeat
            elif peer in kept:  # a newer heartbeat: the peer is back
                kept.remove(peer)
                del newest[peer]
        assert len(dropped) == len(kept) <= capacity


def test_dropped_peers_need_room_for_one() -> None:
    with pytest.raises(ValueError, match="capacity"):
        DroppedPeers(0)
