"""Pushes from peers not read yet are held for a read or two, not counted against them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.deferred import DeferredNotifies
from merge.identity import Identity
from tests.factories import identity
from tests.unit.test_merge_pipeline import make_update

KEYS = [identity(bytes([i + 10])) for i in range(6)]
HEADERS = {k.peer_id: make_update(k, seq=1).signed_header for k in KEYS}


def test_a_newcomers_push_is_applied_once_its_heartbeat_is_read() -> None:
    held = DeferredNotifies()
    newcomer = KEYS[0].peer_id
    assert held.hold(newcomer, HEADERS[newcomer], now=10.0) == []
    # A read that began before the push says nothing yet; the next one finds the heartbeat.
    assert held.after_read(9.5, lambda p: False).refused == []
    settled = held.after_read(10.5, lambda p: p == newcomer)
    assert settled.accepted == [HEADERS[newcomer]] and settled.refused == []
    assert len(held) == 0


def test_a_stranger_is_refused_after_the_reads_it_was_given() -> None:
    held = DeferredNotifies(reads=2)
    stranger = KEYS[1].peer_id
    held.hold(stranger, HEADERS[stranger], now=1.0)
    assert held.after_read(2.0, lambda p: False).refused == []
    assert held.after_read(3.0, lambda p: False).refused == [stranger]
    assert len(held) == 0


def test_a_header_waits_for_its_author_too() -> None:
    held = DeferredNotifies(reads=3)
    sender, author = KEYS[2].peer_id, KEYS[3].peer_id
    held.hold(sender, HEADERS[author], now=1.0)  # a peer passing on another's header
    assert held.after_read(2.0, lambda p: p == sender).accepted == []
    assert held.after_read(3.0, lambda p: p in (sender, author)).accepted == [HEADERS[author]]


def test_a_flood_evicts_the_oldest_and_counts_them() -> None:
    held = DeferredNotifies(capacity=2)
    a, b, c = (k.peer_id for k in KEYS[:3])
    held.hold(a, HEADERS[a], 1.0)
    held.hold(b, HEADERS[b], 2.0)
    assert held.hold(c, HEADERS[c], 3.0) == [a]
    assert held.hold(b, HEADERS[b], 4.0) == []  # one per sender: the latest replaces it
    assert len(held) == 2
    assert DeferredNotifies(capacity=0).hold(a, HEADERS[a], 1.0) == [a]


@pytest.mark.parametrize(("capacity", "reads"), [(-1, 1), (1, 0), (1.5, 1)])
def test_bad_limits_are_refused(capacity: object, reads: object) -> None:
    with pytest.raises(ValueError):
        DeferredNotifies(capacity, reads)  # type: ignore[arg-type]


step = st.one_of(
    st.tuples(st.just("push"), st.integers(0, 5), st.integers(0, 5)),
    st.tuples(st.just("read"), st.sets(st.integers(0, 5)), st.just(0)),
)


@settings(max_examples=200, deadline=None)
@given(steps=st.lists(step, max_size=40), capacity=st.integers(0, 4), reads=st.integers(1, 3))
def test_every_push_is_held_boundedly_then_accepted_or_counted_once(
    steps: list[tuple[str, object, int]], capacity: int, reads: int
) -> None:
    held = DeferredNotifies(capacity, reads)
    waiting: dict[str, tuple[str, int]] = {}  # sender -> (author, reads that judged it)
    pushes = ends = 0  # each push ends once: accepted, refused, evicted or replaced
    for clock, (kind, a, b) in enumerate(steps, start=1):
        if kind == "push":
            sender, author = KEYS[a].peer_id, KEYS[b].peer_id  # type: ignore[index]
            pushes += 1
            ends += waiting.pop(sender, None) is not None  # replaced
            evicted = held.hold(sender, HEADERS[author], float(clock))
            for gone in evicted:
                ends += 1
                waiting.pop(gone, None)
            if sender not in evicted:
                waiting[sender] = (author, 0)
        else:
            live = {KEYS[i].peer_id for i in a}  # type: ignore[union-attr]
            settled = held.after_read(float(clock), live.__contains__)
            accepted = {s.header.author for s in settled.accepted}
            for sender, (author, seen) in list(waiting.items()):
                if sender in live and author in live:
                    assert author in accepted and sender not in settled.refused
                    del waiting[sender]
                    ends += 1
                elif seen + 1 >= reads:
                    assert sender in settled.refused
                    del waiting[sender]
                    ends += 1
                else:
                    assert sender not in settled.refused
                    waiting[sender] = (author, seen + 1)
            assert accepted <= live
        assert len(held) == len(waiting) <= capacity
    assert pushes == ends + len(waiting)


def _key(i: int) -> str:
    return Identity.from_private_bytes(i.to_bytes(4, "big") * 8).peer_id


def test_a_flood_of_fresh_senders_never_evicts_a_known_senders_push() -> None:
    held = DeferredNotifies()  # 64 places, 16 for fresh keys
    restarted = KEYS[0].peer_id  # its updates were applied here before it restarted
    assert held.hold(restarted, HEADERS[restarted], 1.0, known=True) == []
    evicted = []
    for i in range(1000):
        evicted += held.hold(_key(i), HEADERS[KEYS[1].peer_id], 2.0 + i)
    assert restarted not in evicted and len(evicted) == 1000 - 16  # counted, each once
    assert held.num_fresh == 16 and len(held) == 17
    settled = held.after_read(5000.0, lambda p: p == restarted)
    assert settled.accepted == [HEADERS[restarted]]


def test_known_senders_evict_fresh_ones_first_and_each_other_last() -> None:
    held = DeferredNotifies(capacity=3, fresh_capacity=2)
    a, b, c, d, e = (k.peer_id for k in KEYS[:5])
    held.hold(a, HEADERS[a], 1.0)
    held.hold(b, HEADERS[b], 2.0)
    assert held.hold(c, HEADERS[c], 3.0, known=True) == []
    assert held.hold(d, HEADERS[d], 4.0, known=True) == [a]  # the oldest fresh one
    assert held.hold(e, HEADERS[e], 5.0, known=True) == [b]
    assert held.hold(a, HEADERS[a], 6.0) == [a]  # full of known pushes: the fresh one waits
    assert held.hold(b, HEADERS[b], 7.0, known=True) == [c]  # the oldest known one


@settings(max_examples=200, deadline=None)
@given(
    pushes=st.lists(st.tuples(st.integers(0, 30), st.booleans()), max_size=60),
    capacity=st.integers(0, 6),
    data=st.data(),
)
def test_fresh_pushes_stay_within_their_share_and_never_displace_a_known_one(
    pushes: list[tuple[int, bool]], capacity: int, data: st.DataObject
) -> None:
    fresh_capacity = data.draw(st.integers(0, capacity))
    held = DeferredNotifies(capacity, fresh_capacity=fresh_capacity)
    header = HEADERS[KEYS[0].peer_id]
    known_held: set[str] = set()
    for clock, (i, known) in enumerate(pushes):
        sender = f"peer-{i}"
        known_held.discard(sender)  # replaced by this push
        evicted = held.hold(sender, header, float(clock), known=known)
        if not known:
            assert not known_held & set(evicted)
        known_held -= set(evicted)
        if known and sender not in evicted:
            known_held.add(sender)
        assert len(held) <= capacity and held.num_fresh <= fresh_capacity
