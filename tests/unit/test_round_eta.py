"""The ETA to a round's end that the console shows beside its progress."""

from __future__ import annotations

import io

from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from node.events import ConsoleEventLog
from node.round_eta import RoundEta, format_duration


def test_eta_follows_the_pace_since_the_first_step_seen() -> None:
    eta = RoundEta()
    assert eta.estimate(1, 1, 100, now_s=10.0) is None  # start-up before step 1 is not pace
    assert eta.estimate(1, 11, 100, now_s=20.0) == 89.0  # 1 s a step, 89 steps left


def test_a_new_round_starts_a_new_estimate() -> None:
    eta = RoundEta()
    eta.estimate(1, 1, 10, now_s=0.0)
    eta.estimate(1, 10, 10, now_s=9.0)
    assert eta.estimate(2, 1, 10, now_s=100.0) is None


@given(
    first=st.integers(0, 1000),
    more=st.integers(1, 1000),
    left=st.integers(0, 1000),
    elapsed=st.floats(0.001, 1e5),
)
def test_eta_is_steps_left_at_the_pace_seen(
    first: int, more: int, left: int, elapsed: float
) -> None:
    eta = RoundEta()
    planned = first + more + left
    eta.estimate(3, first, planned, now_s=5.0)
    estimate = eta.estimate(3, first + more, planned, now_s=5.0 + elapsed)
    assert estimate is not None and estimate >= 0
    assert abs(estimate - left * elapsed / more) <= 1e-6 * max(1.0, estimate)


def test_durations_read_as_a_clock() -> None:
    assert [format_duration(s) for s in (42, 725, 3723)] == ["0:42", "12:05", "1:02:03"]


def test_into_a_file_progress_is_printed_lines_with_an_eta() -> None:
    out = io.StringIO()
    log = ConsoleEventLog(Console(file=out, force_terminal=False, width=200))
    log.PROGRESS_PERIOD_S = 0.0
    for step in (1, 2, 3):
        log.progress(round=1, step=step, inner_steps=100, loss=4.5, tokens_per_s=1234.0)
    log.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "round 1  step 1/100  loss 4.5000  1,234 tok/s"
    assert lines[2].startswith("round 1  step 3/100  loss 4.5000  1,234 tok/s  ETA ")


def test_into_a_file_progress_is_thinned_to_one_line_a_period() -> None:
    out = io.StringIO()
    log = ConsoleEventLog(Console(file=out, force_terminal=False))
    for step in range(1, 50):
        log.progress(round=1, step=step, inner_steps=100, loss=4.5, tokens_per_s=1.0)
    assert len(out.getvalue().splitlines()) == 1
