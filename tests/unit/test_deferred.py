"""Pushes from peers not read yet are held for a read or two, not counted against them."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.deferred import DeferredNotifies
from merge.identity import Identity
from tests.unit.test_merge_pipeline import make_update

KEYS = [Identity.from_private_bytes(bytes([i + 10]) * 32) for i in range(6)]
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
