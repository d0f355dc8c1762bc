"""What the gossip may fetch whole while a node runs fetch rounds (dht.shard_fetch_hold
`HoldBook`; docs/scale.md, Session 23): an id is never fetched whole while a round may take
it and its hand-over time has not passed, nor while a round is open here within a group wait
of its hand-over; nothing wanted is ever dropped (every id goes by a bounded time)."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from dht.shard_fetch_hold import (
    FALLBACK_ROUNDS,
    IN_ROUND_WAITS,
    UNNOTICED_ROUNDS,
    HoldBook,
)

WAIT_S = 10.0
IDS = [("groups.0b1", 1), ("groups.0b1", 2), ("groups.0b10", 1)]
OWN = ("groups.0b0", 1)


def test_an_update_no_notice_named_is_adopted_with_sources_and_goes_after_one_wait() -> None:
    book = HoldBook()
    uid = IDS[0]
    assert book.verdict(uid, [], 0.0, WAIT_S).held  # no source: held, not adopted
    assert book.verdict(uid, ["m1"], 1.0, WAIT_S).adopt
    assert book.verdict(uid, ["m1"], UNNOTICED_ROUNDS * WAIT_S - 0.1, WAIT_S).held
    late = book.verdict(uid, ["m1"], UNNOTICED_ROUNDS * WAIT_S, WAIT_S)
    assert not late.held and book.cause(uid) == "unnoticed_timer_no_round"


def test_a_notice_holds_it_three_waits_and_a_round_since_names_the_timer() -> None:
    book = HoldBook()
    uid = IDS[0]
    book.noticed(uid, 0.0, WAIT_S)
    assert not book.verdict(uid, ["m1"], 0.0, WAIT_S).adopt  # a candidate already
    book.round_opened(5.0)
    book.round_closed()
    assert book.verdict(uid, [], FALLBACK_ROUNDS * WAIT_S - 0.1, WAIT_S).held
    assert not book.verdict(uid, [], FALLBACK_ROUNDS * WAIT_S, WAIT_S).held
    assert book.cause(uid) == "timer"


def test_one_handed_over_waits_for_the_open_round_at_most_one_wait() -> None:
    book = HoldBook()
    uid = IDS[0]
    book.noticed(uid, 0.0, WAIT_S)
    book.round_opened(1.0)
    book.release(uid, 2.0, "overflow")
    assert book.verdict(uid, [], 2.0 + IN_ROUND_WAITS * WAIT_S - 0.1, WAIT_S).held
    assert not book.verdict(uid, [], 2.0 + IN_ROUND_WAITS * WAIT_S, WAIT_S).held
    book.round_closed()
    assert not book.verdict(uid, [], 3.0, WAIT_S).held


def test_own_group_and_learner_updates_are_never_held_nor_any_once_not_holding() -> None:
    book = HoldBook()
    book.own_key(OWN[0])
    assert not book.verdict(OWN, ["m"], 0.0, WAIT_S).held
    assert not book.verdict(("12D3KooWpeer", 1), ["m"], 0.0, WAIT_S).held
    book.holding = False
    assert not book.verdict(IDS[0], ["m"], 0.0, WAIT_S).held


EVENTS = st.lists(
    st.tuples(
        st.sampled_from(["ask", "ask_sourced", "notice", "open", "close", "applied", "release"]),
        st.sampled_from(IDS),
        st.floats(min_value=0.0, max_value=8.0),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
# the hand-over bound met exactly (notice at 1/3 + 1/3, then a round opens): 40.666... - 30.666...
# rounds to just under one wait in floats, so (3) allows a microsecond past the bound
@example([("ask", IDS[0], 1 / 3), ("notice", IDS[0], 1 / 3), ("open", IDS[0], 0.0)])
def test_never_fetched_whole_while_held_and_nothing_wanted_is_dropped(events: list) -> None:
    """Any interleaving of asks (with and without sources), notices, rounds opening and
    closing, rounds applying ids and hand-overs: (1) while an id's hold stands (`due` not
    reached) every ask holds it; (2) one handed over is held only while a round is open,
    and at most IN_ROUND_WAITS group waits after its hand-over; (3) every id asked goes by
    its first ask or notice + FALLBACK_ROUNDS + IN_ROUND_WAITS group waits, whatever follows."""
    book, now = HoldBook(), 0.0
    first: dict[tuple[str, int], float] = {}
    released_at: dict[tuple[str, int], float] = {}
    round_open = False
    for kind, uid, step in events:
        now += step
        if kind in ("ask", "ask_sourced", "notice"):
            first.setdefault(uid, now)
        if kind == "notice":
            book.noticed(uid, now, WAIT_S)
        elif kind == "open":
            book.round_opened(now)
            round_open = True
        elif kind == "close":
            book.round_closed()
            round_open = False
        elif kind == "applied":
            book.applied(uid)
        elif kind == "release":
            book.release(uid, now, "overflow")
            released_at.setdefault(uid, now)
        else:
            due = book.due(uid)
            verdict = book.verdict(uid, ["m"] if kind == "ask_sourced" else [], now, WAIT_S)
            if due is not None and now < due:
                assert verdict.held  # (1)
            if uid in released_at and verdict.held:
                assert round_open and now - released_at[uid] < IN_ROUND_WAITS * WAIT_S  # (2)
            if not verdict.held:
                released_at.setdefault(uid, now)
    for uid in first:  # (3): asked now, gone within the longest hold, whatever round is open
        book.verdict(uid, ["m"], now, WAIT_S)
        end = now + (FALLBACK_ROUNDS + IN_ROUND_WAITS) * WAIT_S + 1e-6
        assert not book.verdict(uid, ["m"], end, WAIT_S).held
