"""Per-peer budgets: a flooder runs out, others do not notice, memory stays bounded."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.budget import PeerBudget, StreamGuard, StreamLimits


def test_a_flood_spends_only_the_flooders_budget() -> None:
    budget = PeerBudget(rate_per_s=1.0, burst=3)
    assert [budget.allow("flooder", 0.0) for _ in range(5)] == [True, True, True, False, False]
    assert budget.allow("honest", 0.0)
    assert budget.allow("flooder", 1.0) and not budget.allow("flooder", 1.0)  # refilled one


def test_the_table_of_peers_stays_bounded() -> None:
    budget = PeerBudget(rate_per_s=1.0, burst=1, max_peers=100)
    for i in range(10_000):
        budget.allow(f"sybil-{i}", float(i))
    assert len(budget) == 100
    budget.forget("sybil-9999")
    assert len(budget) == 99


def test_a_stream_guard_refuses_a_peer_over_its_rate_or_its_streams_in_flight() -> None:
    guard = StreamGuard(StreamLimits(rate_per_s=1.0, burst=3, max_in_flight=2))
    assert guard.admit("flooder", 0.0) is None and guard.admit("flooder", 0.0) is None
    assert guard.admit("flooder", 0.0) == "busy"  # two running: the third waits for one
    guard.release("flooder")
    assert guard.admit("flooder", 0.0) is None  # the burst's third token
    guard.release("flooder")
    assert guard.admit("flooder", 0.0) == "rate"
    assert guard.admit("honest", 0.0) is None  # others do not notice
    assert guard.admit("flooder", 1.0) is None  # one token back after a second


def test_stream_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="deadline_s"):
        StreamLimits(rate_per_s=1.0, burst=1, deadline_s=0)
    with pytest.raises(ValueError, match="max_in_flight"):
        StreamLimits(rate_per_s=1.0, burst=1, max_in_flight=0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["admit", "release"]), st.integers(0, 50), st.floats(0, 1)),
        max_size=300,
    )
)
def test_a_stream_guard_never_serves_more_than_allowed(
    steps: list[tuple[str, int, float]],
) -> None:
    """Whatever the interleaving: in flight <= max_in_flight per peer, and a peer is admitted
    at most burst + rate * elapsed times."""
    limits = StreamLimits(rate_per_s=2.0, burst=3, max_in_flight=2)
    guard = StreamGuard(limits)
    now = 0.0
    admitted: dict[str, int] = {}
    running: dict[str, int] = {}
    for action, peer, dt in steps:
        now += dt
        peer_id = f"p{peer % 20}"
        if action == "admit" and guard.admit(peer_id, now) is None:
            admitted[peer_id] = admitted.get(peer_id, 0) + 1
            running[peer_id] = running.get(peer_id, 0) + 1
        elif action == "release" and running.get(peer_id, 0) > 0:
            guard.release(peer_id)
            running[peer_id] -= 1
        assert guard.in_flight(peer_id) == running.get(peer_id, 0) <= limits.max_in_flight
        assert admitted.get(peer_id, 0) <= limits.burst + limits.rate_per_s * now + 1e-9
