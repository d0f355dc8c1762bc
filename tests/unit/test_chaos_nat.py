"""bench.chaos_nat's figures read from events (no namespaces needed)."""

from __future__ import annotations

from bench.chaos_nat import state_check_seconds


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
