"""A round's progress keeps apart the time inside its inner steps (`steps_s`, what bench.chaos
counts as compute) and the loop's time around them (`inner_s`), across a save and a restart."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from node.learner import RoundStats
from node.progress import RoundProgress

NUMEL = 4


def _saved(steps_s: float, inner_s: float) -> RoundProgress:
    begun = RoundProgress(torch.zeros(NUMEL), 0)
    done = begun.extended(RoundStats(3, 30, 1.0, steps_s), inner_s)
    return RoundProgress(**{**done.__dict__, "params": torch.ones(NUMEL)})


@given(
    st.floats(0, 1e4, allow_nan=False),
    st.floats(0, 1e4, allow_nan=False),
    st.floats(0, 1e4, allow_nan=False),
)
def test_steps_s_survives_a_save_and_adds_up_across_segments(
    steps_s: float, loop_s: float, more_s: float
) -> None:
    saved = _saved(steps_s, steps_s + loop_s)
    loaded = RoundProgress.from_state_dict(saved.state_dict(), NUMEL, max_steps=10)
    assert (loaded.steps_s, loaded.inner_s) == (saved.steps_s, saved.inner_s)
    finished = loaded.extended(RoundStats(2, 20, 1.0, more_s), more_s)
    assert finished.as_round_stats().compute_s == steps_s + more_s
    assert finished.steps_s <= finished.inner_s


def test_a_partial_round_saved_before_steps_s_counts_its_inner_s() -> None:
    state = _saved(2.0, 3.0).state_dict()
    del state["steps_s"]
    assert RoundProgress.from_state_dict(state, NUMEL, max_steps=10).steps_s == 3.0
