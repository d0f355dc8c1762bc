"""bench.chaos_nat's figures read from events (no namespaces needed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.chaos import ChaosConfig
from bench.chaos_nat import home_slots, homes_for, state_check_seconds
from bench.nat import Home


def test_state_check_time_is_from_listening_to_the_end_of_the_check() -> None:
    restarted = [
        {"event": "listening", "time": 100.0},
        {"event": "startup_phase", "name": "build", "time": 101.0},
        {"event": "startup_phase", "name": "state_check", "time": 107.6},
    ]
    quick = [
        {"event": "listening", "time": 10.0},
        {"event": "startup_phase", "name": "state_check", "time": 12.0},
    ]
    killed_before = [{"event": "listening", "time": 5.0}]
    assert state_check_seconds([restarted, killed_before, quick]) == [2.0, 7.6]


def test_the_default_layout_is_the_issues_two_behind_a_cone_one_behind_a_symmetric_nat() -> None:
    assert home_slots(4, 2) == [(0, 0), (1, 0), (0, 1)]
    assert homes_for(4) == (Home("cone", 2), Home("symmetric", 1))
    assert homes_for(2) == (Home("cone", 1), Home("symmetric", 1))  # an empty home keeps one


def test_a_second_cone_home_gives_a_pair_behind_two_cone_nats() -> None:
    nats = ["cone", "cone", "symmetric"]
    assert homes_for(4, nats) == (Home("cone"), Home("cone"), Home("symmetric"))
    assert home_slots(4, 3) == [(0, 0), (1, 0), (2, 0)]


@given(st.integers(2, 40), st.integers(1, 6))
def test_every_nated_node_has_its_own_machine_in_a_home_that_exists(
    num_nodes: int, num_homes: int
) -> None:
    slots = home_slots(num_nodes, num_homes)
    homes = homes_for(num_nodes, ["cone"] * num_homes)
    assert len(slots) == len(set(slots)) == num_nodes - 1
    assert all(0 <= j < homes[r].num_hosts for r, j in slots)


def test_observers_and_nats_are_checked() -> None:
    with pytest.raises(ValueError):
        ChaosConfig(topology="nat", observers=-1)
    with pytest.raises(ValueError):
        ChaosConfig(topology="nat", nats="cone,full")
    assert ChaosConfig(nats="cone,cone,symmetric", observers=3).nat_list == [
        "cone",
        "cone",
        "symmetric",
    ]
