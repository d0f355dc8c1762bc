"""Whom a starting node dials and how long it keeps trying: the pure policy, then the dialler
over real sockets with a fake clock (no sleeping)."""

from __future__ import annotations

import logging
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dht.bootstrap_retry import (
    MAX_KNOWN_TRIED,
    MIN_WAIT_S,
    BootstrapRetry,
    RejoinBackoff,
    RejoinBounds,
    RetryBounds,
    candidates,
)
from dht.preflight import PreflightError, reach_peers

PEER = "12D3KooWGgtHxHyqJ2bBHB6YPBFu2yC7n1AVXsbuXrBjVt3jxY3E"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.waits: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)
        self.now += seconds


def maddr(port: int) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER}"


bounds_st = st.builds(
    RetryBounds,
    first_delay_s=st.floats(0.01, 10),
    max_delay_s=st.floats(10, 60),
    give_up_after_s=st.floats(0, 600),
)


@given(bounds_st, st.lists(st.floats(0, 30), max_size=60))
def test_waits_double_up_to_the_cap_and_no_attempt_starts_after_the_bound(
    bounds: RetryBounds, probe_times_s: list[float]
) -> None:
    clock = FakeClock()
    retry = BootstrapRetry(bounds, clock)
    previous = 0.0
    for probe_s in probe_times_s:
        clock.now += probe_s  # the attempt itself takes time
        wait = retry.failed()
        if wait is None:
            assert retry.elapsed_s >= bounds.give_up_after_s - MIN_WAIT_S
            return
        assert 0 < wait <= bounds.max_delay_s
        assert retry.elapsed_s + wait <= bounds.give_up_after_s + 1e-9
        uncut = retry.next_delay_s()
        assert uncut >= previous  # never shorter than the wait before
        previous = uncut
        clock.sleep(wait)


@given(bounds_st)
def test_a_node_that_never_reaches_anyone_gives_up_within_the_bound(bounds: RetryBounds) -> None:
    clock = FakeClock()
    retry = BootstrapRetry(bounds, clock)
    while (wait := retry.failed()) is not None:
        clock.sleep(wait)
    assert clock.now - 1000.0 <= bounds.give_up_after_s + 1e-9
    assert retry.num_failed <= 2 + bounds.give_up_after_s / bounds.first_delay_s


def test_the_first_waits_are_one_two_four_seconds() -> None:
    clock = FakeClock()
    retry = BootstrapRetry(RetryBounds(first_delay_s=1, max_delay_s=3, give_up_after_s=100), clock)
    assert [retry.failed(), retry.failed(), retry.failed(), retry.failed()] == [1, 2, 3, 3]


@given(
    st.lists(st.sampled_from("abcdef"), max_size=6),
    st.lists(st.sampled_from("defghijklmnopq"), max_size=20),
)
def test_candidates_are_the_bootstrap_then_a_bounded_few_known_peers_each_once(
    bootstrap: list[str], known: list[str]
) -> None:
    chosen = candidates(bootstrap, known)
    assert len(chosen) == len(set(chosen))
    assert chosen[: len(set(bootstrap))] == list(dict.fromkeys(bootstrap))
    extra = chosen[len(set(bootstrap)) :]
    assert len(extra) <= MAX_KNOWN_TRIED
    assert extra == [k for k in dict.fromkeys(known) if k not in bootstrap][:MAX_KNOWN_TRIED]


@pytest.mark.parametrize(
    "kwargs",
    [{"first_delay_s": 0}, {"first_delay_s": 5, "max_delay_s": 1}, {"give_up_after_s": -1}],
)
def test_nonsense_bounds_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryBounds(**kwargs)


def test_a_bootstrap_that_starts_listening_late_is_reached(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = FakeClock()
    with socket.socket() as late:
        late.bind(("127.0.0.1", 0))  # bound, not listening yet: connections are refused
        address = maddr(late.getsockname()[1])

        def sleep(seconds: float) -> None:
            clock.sleep(seconds)
            if len(clock.waits) == 2:
                late.listen()  # the busy bootstrap comes up during the second wait

        with caplog.at_level(logging.WARNING, logger="dht.preflight"):
            got = reach_peers([address], [], timeout_s=2, clock=clock, sleep=sleep)
    assert got == [address]
    assert clock.waits == [1.0, 2.0]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # one line per failed attempt: where, why, when again
    assert address in lines[0] and "refused" in lines[0] and "retrying in 1 s" in lines[0]


def test_a_dead_bootstrap_gives_way_to_a_known_peer() -> None:
    with socket.socket() as dead, socket.socket() as member:
        dead.bind(("127.0.0.1", 0))
        member.bind(("127.0.0.1", 0))
        member.listen()
        bootstrap, known = maddr(dead.getsockname()[1]), maddr(member.getsockname()[1])
        clock = FakeClock()
        got = reach_peers([bootstrap], [known], timeout_s=2, clock=clock, sleep=clock.sleep)
    assert got == [known]
    assert clock.waits == []  # no waiting when a known member answers


def test_nobody_answering_ends_in_one_line_after_the_bound() -> None:
    with socket.socket() as dead, socket.socket() as gone:
        dead.bind(("127.0.0.1", 0))
        gone.bind(("127.0.0.1", 0))
        bootstrap, known = maddr(dead.getsockname()[1]), maddr(gone.getsockname()[1])
        clock = FakeClock()
        bounds = RetryBounds(first_delay_s=1, max_delay_s=4, give_up_after_s=10)
        with pytest.raises(PreflightError) as raised:
            reach_peers([bootstrap], [known], bounds=bounds, clock=clock, sleep=clock.sleep)
    message = str(raised.value)
    assert "\n" not in message
    assert f"no bootstrap peer reachable at {bootstrap} nor at 1 peers known" in message
    assert "after 5 attempts in 10 s" in message
    assert sum(clock.waits) == 10  # 1 + 2 + 4 + 3 (cut to the bound)


def test_a_node_without_peers_starts_a_swarm_and_dials_no_one() -> None:
    assert reach_peers([], ["/ip4/127.0.0.1/tcp/9/p2p/" + PEER], sleep=_no_sleep) == []


def _no_sleep(seconds: float) -> None:
    raise AssertionError("nothing to wait for")


# ---- a known member's background dialling (dht.bootstrap_rejoin) ----------------------------

rejoin_bounds_st = st.builds(
    RejoinBounds, first_delay_s=st.floats(0.01, 10), max_delay_s=st.floats(10, 60)
)


@given(rejoin_bounds_st, st.lists(st.tuples(st.booleans(), st.floats(0, 30)), max_size=80))
def test_rejoin_dials_at_once_backs_off_to_the_cap_and_resets_when_connected(
    bounds: RejoinBounds, steps: list[tuple[bool, float]]
) -> None:
    """Alone, a dial is due at once after a start or a loss; after each failed dial the wait
    doubles from the first delay up to the cap; being connected resets it. It never gives up."""
    now = 0.0
    backoff = RejoinBackoff(bounds, now)
    assert backoff.alone(now)
    failed = 0
    for connected, advance in steps:
        if connected:
            backoff.connected(now)
            failed = 0
            assert backoff.alone(now)  # a later loss dials at once
        elif backoff.alone(now):
            wait_s = backoff.failed(now)
            failed += 1
            expected = min(bounds.max_delay_s, bounds.first_delay_s * 2 ** (failed - 1))
            assert wait_s == pytest.approx(expected)
            assert bounds.first_delay_s <= wait_s <= bounds.max_delay_s
            assert not backoff.alone(now + wait_s * 0.999)
            assert backoff.alone(now + wait_s)
        now += advance


def test_rejoin_waits_one_two_then_three_seconds_forever() -> None:
    """p2pd's own dial backoff (5 s + k^2 s) spaces the real dials: a longer cap only adds to
    it (RejoinBounds)."""
    backoff = RejoinBackoff(RejoinBounds(), 0.0)
    assert [backoff.failed(0.0) for _ in range(5)] == [1.0, 2.0, 3.0, 3.0, 3.0]


@pytest.mark.parametrize("kwargs", [{"first_delay_s": 0}, {"first_delay_s": 9, "max_delay_s": 3}])
def test_nonsense_rejoin_bounds_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RejoinBounds(**kwargs)
