"""dht.realign_class: a member left out of its group's fetch round (for its state or its base)
downloads a class member's state at its next round, from a majority class only, under a cap;
so one lying member cannot pull the others, and a member apart costs a bounded number of
state downloads."""

from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.realign_class import ClassRealign, ClassRealignConfig, LeftOut, donor_for, is_majority

MEMBERS = ["m0", "m1", "m2", "m3"]


def realign(me: str = "m3", **config: float) -> ClassRealign:
    return ClassRealign(me, ClassRealignConfig(**config))  # type: ignore[arg-type]


def test_left_out_for_its_state_it_realigns_from_a_class_member_at_the_next_round() -> None:
    r = realign()
    r.left_out(["m0", "m1", "m2"], MEMBERS, "left_out_state")
    got = r.decide(MEMBERS, now=10.0)
    assert got is not None and got[0] in ("m0", "m1", "m2")
    assert got[1].reason == "left_out_state"
    assert r.decide(MEMBERS, now=100.0) is None  # the note is spent: one download for it


def test_left_out_for_its_base_realigns_too() -> None:
    r = realign()
    r.left_out(["m0", "m1", "m2"], MEMBERS, "left_out_base")
    assert r.decide(MEMBERS, now=0.0) is not None


def test_a_round_with_this_member_in_its_class_clears_the_note() -> None:
    r = realign()
    r.left_out(["m0", "m1", "m2"], MEMBERS, "left_out_state")
    r.aligned()
    assert r.decide(MEMBERS, now=0.0) is None


def test_no_majority_class_pulls_nobody() -> None:
    """Two of four (a liar that copied one honest member's blocks, and that member): a tie,
    no majority, nobody realigns from it."""
    r = realign()
    r.left_out(["m0", "m1"], MEMBERS, "left_out_state")
    assert r.decide(MEMBERS, now=0.0) is None


def test_other_reasons_and_a_class_holding_this_member_are_no_left_out() -> None:
    r = realign()
    r.left_out(["m0", "m1", "m2"], MEMBERS, "state_differs")
    assert r.decide(MEMBERS, now=0.0) is None
    r.left_out(["m1", "m2", "m3"], MEMBERS, "left_out_state")
    assert r.decide(MEMBERS, now=0.0) is None


def test_class_members_gone_from_the_next_round_are_no_donors() -> None:
    r = realign()
    r.left_out(["m0", "m1", "m2"], MEMBERS, "left_out_state")
    got = r.decide(["m2", "m3"], now=0.0)
    assert got is not None and got[0] == "m2"
    r.left_out(["m0", "m1", "m2"], MEMBERS, "left_out_state")
    assert r.decide(["m3", "m4"], now=100.0) is None


def test_two_left_out_download_from_two_donors() -> None:
    left = LeftOut(("a", "b", "c", "d", "e"), ("a", "b", "c"), "left_out_state")
    assert donor_for(left, "d", left.members) != donor_for(left, "e", left.members)


def test_the_cap_and_the_cooldown_bound_downloads() -> None:
    r = realign(max_attempts=2, window_s=100.0, cooldown_s=10.0)
    times, got = [0.0, 5.0, 12.0, 30.0, 99.0, 105.0, 113.0], []
    for now in times:
        r.left_out(["m0", "m1", "m2"], MEMBERS, "left_out_state")
        got.append(r.decide(MEMBERS, now) is not None)
    # 0: yes; 5: cooldown; 12: yes; 30, 99: two in the window; 105: 0 left it; 113: cooldown
    assert got == [True, False, True, False, False, True, False]


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        ClassRealignConfig(max_attempts=0)
    with pytest.raises(ValueError):
        ClassRealignConfig(cooldown_s=-1.0)


peers = st.sampled_from([f"p{i}" for i in range(8)])


@settings(max_examples=100, deadline=None)
@given(
    members=st.lists(peers, min_size=2, max_size=8, unique=True),
    cls=st.lists(peers, max_size=8, unique=True),
    me=peers,
    now_members=st.lists(peers, max_size=8, unique=True),
)
def test_a_donor_is_always_another_member_of_a_majority_class_still_present(
    members: list[str], cls: list[str], me: str, now_members: list[str]
) -> None:
    cls = [m for m in cls if m in members]
    left = LeftOut(tuple(sorted(members)), tuple(sorted(cls)), "left_out_state")
    donor = donor_for(left, me, now_members)
    if donor is not None:
        assert donor in cls and donor in now_members and donor != me
        assert me not in cls
        assert 2 * len(cls) > len(members) and len(cls) >= 2
    elif me not in cls and is_majority(cls, members):
        assert not [m for m in cls if m in now_members]


@settings(max_examples=100, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=50.0), min_size=1, max_size=60),
    max_attempts=st.integers(1, 5),
    window_s=st.floats(min_value=1.0, max_value=300.0),
    cooldown_s=st.floats(min_value=0.0, max_value=60.0),
)
def test_never_more_downloads_than_the_cap_in_any_window(
    gaps: list[float], max_attempts: int, window_s: float, cooldown_s: float
) -> None:
    """Left out at every round, at any pace: at most `max_attempts` downloads in any window
    and none closer than the cooldown."""
    r = realign(max_attempts=max_attempts, window_s=window_s, cooldown_s=cooldown_s)
    now, started = 0.0, []
    for gap in gaps:
        now += gap
        r.left_out(["m0", "m1", "m2"], MEMBERS, "left_out_state")
        if r.decide(MEMBERS, now) is not None:
            started.append(now)
    for i, t in enumerate(started):
        assert sum(1 for u in started if t - window_s < u <= t) <= max_attempts
        if i:
            assert t - started[i - 1] >= cooldown_s
    assert r.num_attempts == len(started)


@settings(max_examples=100, deadline=None)
@given(
    members=st.lists(peers, min_size=3, max_size=8, unique=True),
    data=st.data(),
)
def test_every_left_out_member_decides_alike_from_the_same_round(
    members: list[str], data: st.DataObject
) -> None:
    """The decision reads the composed round only: the same round on two calls, the same
    donor; and members of the class never download."""
    size = data.draw(st.integers(len(members) // 2 + 1, len(members)))
    cls = sorted(data.draw(st.permutations(members)))[:size]
    for me in members:
        a, b = realign(me), realign(me)
        a.left_out(cls, members, "left_out_state")
        b.left_out(list(reversed(cls)), list(reversed(members)), "left_out_state")
        got_a, got_b = a.decide(members, 0.0), b.decide(members, 0.0)
        assert got_a == got_b
        assert (got_a is None) == (me in cls)


def test_the_fetch_round_takes_a_class_members_state_before_proposing() -> None:
    """The wiring (dht.group_exchange_fetch): left out of the last round's class, the next
    round downloads from a class member through `realign` and records it on the round."""
    from dht.shard_fetch_inbox import Inbox
    from tests.unit.test_shard_fetch_fallback import _exchange

    async def run() -> tuple[list[str], Inbox, Inbox]:
        exchange = _exchange(set(), [], [])
        me = exchange.identity.peer_id
        members = sorted(["a", "b", "c", me])
        asked: list[str] = []

        async def realign(donor: str) -> bool:
            asked.append(donor)
            return True

        exchange.realign = realign
        exchange.class_realign.left_out(["a", "b", "c"], members, "left_out_state")
        first, second = Inbox(), Inbox()
        for inbox in (first, second):
            task = exchange._realign_from_class(members, inbox)
            if task is not None:
                await exchange._realigned(task, inbox, 1.0)
        return asked, first, second

    asked, first, second = asyncio.run(run())
    assert len(asked) == 1 and asked[0] in ("a", "b", "c")
    assert first.realigned_from == asked[0] and first.realign_loaded is True
    assert second.realigned_from is None  # one download for one left-out


def test_due_says_whether_the_next_round_will_realign() -> None:
    r = realign(max_attempts=1, window_s=100.0)
    assert not r.due(0.0)  # no note
    r.left_out(["m0", "m1"], MEMBERS, "left_out_state")
    assert not r.due(0.0)  # a tie: no majority
    r.left_out(["m0", "m1", "m2"], MEMBERS, "left_out_state")
    assert r.due(0.0) and r.decide(MEMBERS, 1.0) is not None
    r.left_out(["m0", "m1", "m2"], MEMBERS, "left_out_state")
    assert not r.due(2.0)  # the cap is spent: this left-out fetches whole as before


@settings(max_examples=100, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.floats(min_value=0.0, max_value=40.0), st.integers(0, 4)),
        min_size=1,
        max_size=30,
    ),
    cooldown_s=st.floats(min_value=0.0, max_value=60.0),
)
def test_a_due_note_is_acted_on_at_any_later_next_round(
    steps: list[tuple[float, int]], cooldown_s: float
) -> None:
    """What `due` promised when the member skipped its whole fetch, `decide` keeps at the
    next round however late it comes (the class still there)."""
    r = realign(max_attempts=2, window_s=120.0, cooldown_s=cooldown_s)
    now = 0.0
    for gap, later in steps:
        now += gap
        r.left_out(["m0", "m1", "m2"], MEMBERS, "left_out_state")
        if r.due(now):
            assert r.decide(MEMBERS, now + later * 30.0) is not None
            now += later * 30.0
        else:
            r.decide(MEMBERS, now)


def test_a_member_that_will_realign_fetches_nothing_whole_and_one_that_will_not_does() -> None:
    """The wiring: left out with a download due, the round's ids are not fetched whole
    (the class's state brings them); without a way to realign, or past the cap, they are."""
    from tests.unit.test_shard_fetch_fallback import _exchange

    async def realign_ok(donor: str) -> bool:
        return True

    async def run() -> list[bool]:
        exchange = _exchange(set(), [], [])
        me = exchange.identity.peer_id
        members = sorted(["a", "b", "c", me])
        exchange.class_realign.left_out(["a", "b", "c"], members, "left_out_state")
        found = [exchange._waits_for_class("left_out_state")]  # no `realign` wired
        exchange.realign = realign_ok
        found += [
            exchange._waits_for_class("left_out_state"),
            exchange._waits_for_class("state_differs"),
        ]
        exchange.class_realign.config = ClassRealignConfig(max_attempts=1)
        exchange.class_realign._attempts.append(time.monotonic())
        found.append(exchange._waits_for_class("left_out_state"))
        for task in list(exchange._tasks):
            task.cancel()
        return found

    assert asyncio.run(run()) == [False, True, False, False]
