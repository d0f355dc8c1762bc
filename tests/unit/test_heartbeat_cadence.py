"""dht.heartbeat_cadence: heartbeats on a fixed cadence, whatever a store costs."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from dht.heartbeat_cadence import MAX_IN_FLIGHT, Cadence

PERIOD = 4.0
STEP = 0.05


def run(store_s: list[float], until: float) -> list[float]:
    """When each store starts on a virtual clock ticking every STEP, store k taking
    `store_s[k % len(store_s)]` seconds."""
    cadence = Cadence(PERIOD, next_at=0.0)
    starts: list[float] = []
    ends: list[float] = []
    for tick in range(int(until / STEP)):
        now = tick * STEP
        for end in [e for e in ends if e <= now]:
            ends.remove(end)
            cadence.done(now, stored=True)
        if cadence.start(now):
            ends.append(now + store_s[len(starts) % len(store_s)])
            starts.append(now)
    return starts


def test_a_slow_store_does_not_stretch_the_cadence() -> None:
    # stores of 3 s: "wait a period, then store" sent every 7 s, past a peer's 3 x 4 s window
    # once a read or two lag; on the cadence a store starts every 4 s
    starts = run([3.0], until=40.0)
    gaps = [b - a for a, b in pairwise(starts)]
    assert max(gaps) <= PERIOD + STEP


def test_a_store_stuck_longer_than_a_period_does_not_hold_the_next_back() -> None:
    starts = run([9.0, 0.5, 0.5, 0.5], until=20.0)
    assert starts[1] <= PERIOD + STEP  # the first is still in flight then


def test_a_stall_restarts_the_cadence_from_now_without_a_burst() -> None:
    cadence = Cadence(PERIOD, next_at=0.0)
    assert cadence.start(0.0)
    cadence.done(0.5, stored=True)
    assert cadence.start(30.0)  # the loop stalled 30 s
    assert not cadence.start(30.0) and cadence.wait_s(30.0) == PERIOD


def test_the_gap_between_two_stored_heartbeats_is_reported_past_two_periods() -> None:
    cadence = Cadence(PERIOD, next_at=0.0, last_stored=0.0)
    assert cadence.start(0.0)
    assert cadence.done(1.0, stored=True) is None
    assert cadence.start(4.0)
    assert cadence.done(5.0, stored=False) is None  # failed: no heartbeat stored
    assert cadence.start(8.0)
    assert cadence.done(9.5, stored=True) == 8.5


@given(st.lists(st.floats(0.0, 30.0), min_size=1, max_size=8))
def test_never_more_than_max_in_flight_and_never_two_starts_within_a_period(
    store_s: list[float],
) -> None:
    starts = run(store_s, until=60.0)
    assert all(b - a >= PERIOD - STEP for a, b in pairwise(starts))
    ends = sorted((s, s + store_s[i % len(store_s)]) for i, s in enumerate(starts))
    for s, _ in ends:
        assert sum(a <= s < b for a, b in ends) <= MAX_IN_FLIGHT
