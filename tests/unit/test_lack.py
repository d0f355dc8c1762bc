"""merge.lack: what an update's author lacked of what the replica holds signed before it."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from merge.lack import LackMeter, lacked_updates


def test_an_update_on_time_lacks_nothing() -> None:
    meter = LackMeter()
    for t in range(10):
        meter.applied(float(t), 1.0)
    # Its author held all 10 when it published at t = 9.5.
    assert meter.lack(10, 9.5, 10) == 0


def test_a_partitioned_authors_backlog_lacks_what_the_others_trained_meanwhile() -> None:
    """10 updates before a partition; meanwhile 3 other partitions publish one update each at
    t = 10..14, and the author alone its own, counted 11..15 by it. Its update signed at 12.5
    (published_applied 12: 10 and its own 2) lacks the others' 3 x 3 signed by then; the
    receiver holds 2 fewer of the author's own (not counted against it: never an overcount)."""
    meter = LackMeter()
    for t in range(10):
        meter.applied(float(t), 1.0)
    for t in range(10, 15):
        for _ in range(3):
            meter.applied(float(t), 1.0)
    held = 10 + 15
    assert meter.lack(held, 12.5, 12) == (10 + 9) - 12
    assert lacked_updates(meter.lack(held, 12.5, 12), 4) == 3  # one round (4) forgiven
    assert lacked_updates(meter.lack(held, 14.5, 14), 4) == 7  # 25 - 14 - 4


def test_updates_signed_after_it_do_not_count() -> None:
    meter = LackMeter()
    for t in (1.0, 2.0, 3.0, 50.0, 60.0):
        meter.applied(t, 1.0)
    assert meter.lack(5, 3.0, 3) == 0
    assert meter.lack(5, 3.0, 1) == 2


def test_shares_count_as_the_replicas_progress_does() -> None:
    """A budget-cut or zeroed update counts by its credited share (0: not at all), so a flood
    of zeros signed after an update does not raise its lack."""
    meter = LackMeter()
    meter.applied(1.0, 1.0)
    for _ in range(100):
        meter.applied(5.0, 0.0)
    meter.applied(6.0, 0.5)
    assert len(meter) == 2
    assert meter.lack(1, 4.0, 1) == 0  # progress 1 (floor of 1.5)


def test_lacked_updates_forgives_one_round() -> None:
    assert [lacked_updates(n, 4) for n in (0, 3, 4, 5, 11)] == [0, 0, 0, 1, 7]
    assert lacked_updates(5, 1) == 4
    assert lacked_updates(9, 4, slack_rounds=0) == 9
    for bad in ((1, 0), (-1, 4)):
        with pytest.raises(ValueError):
            lacked_updates(*bad)


def test_the_window_forgets_the_oldest_and_they_count_as_before() -> None:
    meter = LackMeter(window=3)
    for t in (10.0, 1.0, 2.0, 3.0):  # the 10.0 leaves the window first
        meter.applied(t, 1.0)
    assert len(meter) == 3
    assert meter.lack(4, 2.5, 0) == 3  # 1.0, 2.0 and the forgotten one


def test_state_round_trips_and_malformed_state_changes_nothing() -> None:
    meter = LackMeter()
    for t in (3.0, 1.0, 2.0):
        meter.applied(t, 0.5)
    other = LackMeter()
    other.load_state_dict(meter.state_dict())
    assert other.state_dict() == meter.state_dict()
    assert other.lack(2, 1.5, 0) == meter.lack(2, 1.5, 0)
    malformed = [[1.0]], [[1.0, 2.0]], [[math.nan, 1.0]], [[1, 1.0]], [[1.0, 0.0]]
    for bad in (None, {}, *({"recent": r} for r in malformed)):
        with pytest.raises(ValueError):
            other.load_state_dict(bad)
        assert other.state_dict() == meter.state_dict()
    with pytest.raises(ValueError):
        meter.applied(math.inf, 1.0)
    with pytest.raises(ValueError):
        meter.applied(1.0, 1.5)


@given(
    seed=st.integers(0, 2**32 - 1),
    authors=st.integers(2, 8),
    rounds=st.integers(2, 30),
    in_flight=st.floats(0.0, 0.9),
)
def test_replicas_that_got_a_swarms_updates_in_any_order_weigh_fresh_ones_alike(
    seed: int, authors: int, rounds: int, in_flight: float
) -> None:
    """A swarm of `authors` publishing once a round (time units, each at its own phase), each
    author holding every
    update signed more than `in_flight` of a round before it publishes: on every replica, in
    any order of arrival, every update lacks no more than its slack: weighed alike."""
    rng = random.Random(seed)  # each author at its own phase of the round, jittered
    signed = sorted(
        (r + (a + rng.uniform(0.0, 0.1)) / authors, a)
        for r in range(rounds)
        for a in range(authors)
    )
    published = [sum(1 for t, _ in signed if t < s - in_flight) for s, _ in signed]
    for _ in range(2):
        meter = LackMeter()
        order = sorted(range(len(signed)), key=lambda i: signed[i][0] + rng.random() * 3)
        for held, i in enumerate(order):
            assert lacked_updates(meter.lack(held, signed[i][0], published[i]), authors) == 0
            meter.applied(signed[i][0], 1.0)


@given(st.lists(st.tuples(st.floats(-1e6, 1e6), st.floats(0.01, 1.0)), max_size=60),
       st.floats(-1e6, 1e6), st.integers(0, 100))  # fmt: skip
def test_lack_is_never_negative_and_never_more_than_held_beyond_the_count(
    entries: list[tuple[float, float]], at: float, published: int
) -> None:
    meter = LackMeter(window=16)
    for t, c in entries:
        meter.applied(t, c)
    held = math.floor(sum(c for _, c in entries))
    assert 0 <= meter.lack(held, at, published) <= max(0, held - published)
