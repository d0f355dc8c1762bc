"""bench.restart's partial_save_s: the save period a run measured, not the bound."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from bench.restart import partial_save_s
from node.persistence import PARTIAL_SAVE_S


def saved(copied_at: float, *, background: bool = True) -> dict:
    return {"event": "checkpoint_saved", "time": copied_at + 0.1, "copied_at": copied_at,
            "background": background}  # fmt: skip


def test_the_median_gap_between_background_saves_is_the_period() -> None:
    events = [saved(10.0), saved(11.0), {"event": "round_done", "time": 11.5}, saved(12.2)]
    events += [saved(12.5, background=False), saved(13.2), saved(19.0)]  # a round's end save
    assert partial_save_s(events) == 1.1  # gaps 1.0, 1.2, 1.0, 5.8


def test_with_fewer_than_two_saves_it_is_the_bound() -> None:
    assert partial_save_s([saved(3.0), saved(4.0, background=False)]) == PARTIAL_SAVE_S


@given(st.lists(st.floats(min_value=0.01, max_value=10.0), min_size=1, max_size=30))
def test_it_lies_between_the_shortest_and_the_longest_gap(gaps: list[float]) -> None:
    times = [0.0]
    for gap in gaps:
        times.append(times[-1] + gap)
    period = partial_save_s([saved(t) for t in times])
    assert min(gaps) - 1e-3 <= period <= max(gaps) + 1e-3
