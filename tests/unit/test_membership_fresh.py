"""An established node acts on every peer with a record and on few fresh keys.

bench.attack's sybil_vouchers: 8 Sybil heartbeats beside the poisoner and its accomplice made
each honest node push every header to 8 hostless keys and compare notes with 3 of them every
2 s. `established_view` keeps every peer with an applied record (or in a learner group) and
the MAX_FRESH_PEERS fresh ones seen first; a node with no record of any live peer keeps all.
"""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.heartbeat import Heartbeat
from dht.membership import MAX_FRESH_PEERS, PeerView, established_view
from merge.identity import Identity
from tests.unit.test_membership_hold import Reads, membership, record, use


def view(peer_id: str, first_seen: float, group_bits: int | None = None) -> PeerView:
    return PeerView(Heartbeat(peer_id=peer_id, group_bits=group_bits), first_seen, first_seen)


def test_sybils_beyond_the_bound_are_set_aside_and_a_record_keeps_a_peer() -> None:
    honest = view("honest", 0.0)
    sybils = [view(f"sybil{i}", 1.0 + i) for i in range(8)]
    newcomer = view("newcomer", 20.0)
    alive = [honest, *sybils, newcomer]
    kept = established_view(alive, lambda p: p == "honest", MAX_FRESH_PEERS)
    assert [v.heartbeat.peer_id for v in kept] == ["honest", "sybil0", "sybil1"]
    # once one of its updates is applied here, the newcomer is acted on like any peer
    kept = established_view(alive, lambda p: p in ("honest", "newcomer"), MAX_FRESH_PEERS)
    assert [v.heartbeat.peer_id for v in kept] == ["honest", "sybil0", "sybil1", "newcomer"]


def test_a_swarm_that_starts_at_once_admits_as_many_fresh_keys_as_established_peers() -> None:
    alive = [view(f"p{i}", float(i)) for i in range(10)]
    kept = established_view(alive, lambda p: p in ("p0", "p1", "p2", "p3"), MAX_FRESH_PEERS)
    assert [v.heartbeat.peer_id for v in kept] == [f"p{i}" for i in range(8)]


def test_a_node_without_any_record_acts_on_every_live_peer() -> None:
    alive = [view(f"p{i}", float(i)) for i in range(6)]
    assert established_view(alive, lambda p: False, MAX_FRESH_PEERS) == alive


def test_a_learner_group_member_is_established_without_an_update_of_its_own() -> None:
    fresh = [view("b", 1.0), view("c", 2.0), view("d", 3.0)]
    alive = [view("a", 0.0), *fresh, view("member", 4.0, group_bits=2)]
    kept = established_view(alive, lambda p: p == "a", 1)
    assert [v.heartbeat.peer_id for v in kept] == ["a", "b", "c", "member"]


@settings(max_examples=300, deadline=None)
@given(
    peers=st.lists(st.tuples(st.integers(0, 30), st.booleans(), st.booleans()), max_size=24).map(
        lambda xs: [(f"p{i}", float(t), r, g) for i, (t, r, g) in enumerate(xs)]
    ),
    max_fresh=st.integers(0, 4),
    order=st.randoms(use_true_random=False),
)
def test_every_established_peer_kept_fresh_ones_bounded_whatever_the_order(
    peers: list[tuple[str, float, bool, bool]], max_fresh: int, order: object
) -> None:
    records = {p for p, _, r, _ in peers if r}
    alive = [view(p, t, 1 if g else None) for p, t, _, g in peers]
    kept = established_view(alive, records.__contains__, max_fresh)
    ids = [v.heartbeat.peer_id for v in kept]
    established = {p for p, _, r, g in peers if r or g}
    assert ids == [v.heartbeat.peer_id for v in alive if v.heartbeat.peer_id in set(ids)]
    if not established:
        assert ids == [p for p, *_ in peers]
        return
    assert established <= set(ids)
    fresh = set(ids) - established
    allowed = max(max_fresh, len(established))
    assert len(fresh) == min(allowed, len(peers) - len(established))
    # the fresh peers kept are those seen first, whatever order the views come in
    shuffled = list(alive)
    order.shuffle(shuffled)  # type: ignore[attr-defined]
    again = established_view(shuffled, records.__contains__, max_fresh)
    assert {v.heartbeat.peer_id for v in again} == set(ids)
    seen_first = max((t for p, t, *_ in peers if p in fresh), default=-1.0)
    assert all(t >= seen_first for p, t, *_ in peers if p not in established and p not in fresh)


def test_membership_sets_fresh_keys_aside_but_still_hears_them() -> None:
    """Wiring: alive_peers is bounded by the replica's records, is_alive is not (a newcomer
    set aside still has its pushes and summary requests taken)."""
    me, honest = Identity.generate(), Identity.generate()
    sybils = [Identity.generate() for _ in range(5)]
    m = membership(me, [record(me) | record(honest)])
    asyncio.run(m.send_heartbeat())
    asyncio.run(m.poll())  # the honest peer is seen first
    use(m, Reads(m.config, [record(me) | record(honest) | {
        k: v for s in sybils for k, v in record(s).items()
    }]))  # fmt: skip
    asyncio.run(m.poll())
    m.has_record = lambda peer_id: peer_id == honest.peer_id
    acted_on = {h.peer_id for h in m.alive_peers()}
    assert honest.peer_id in acted_on and len(acted_on) == 1 + MAX_FRESH_PEERS
    assert m.num_fresh_set_aside == len(sybils) - MAX_FRESH_PEERS
    assert all(m.is_alive(s.peer_id) for s in sybils)
    m.has_record = None
    assert len(m.alive_peers()) == 1 + len(sybils)
