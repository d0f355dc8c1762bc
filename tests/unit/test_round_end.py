"""What a round whose steps are done does (node.progress.round_end): published once the swarm
is entered, else set aside while the next round trains, one at most, else it waits."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.progress import round_end


@pytest.mark.parametrize(
    ("caught_up", "aside_waiting", "may_set_aside"),
    list(itertools.product((False, True), repeat=3)),
)
def test_published_once_entered_set_aside_only_when_nothing_waits_and_a_round_follows(
    caught_up: bool, aside_waiting: bool, may_set_aside: bool
) -> None:
    end = round_end(caught_up=caught_up, aside_waiting=aside_waiting, may_set_aside=may_set_aside)
    assert (end == "publish") == caught_up
    assert (end == "set_aside") == (not caught_up and not aside_waiting and may_set_aside)


@given(
    st.integers(0, 12),
    st.lists(st.booleans(), min_size=1, max_size=12),
    st.lists(st.integers(0, 3), min_size=12, max_size=12),
)
def test_rounds_are_published_once_in_order_with_one_set_aside_at_most(
    entered_after: int, may: list[bool], entered_at_step: list[int]
) -> None:
    """A node's rounds as node.trainer runs them: the swarm is entered and the state checked
    at step `entered_at_step` of round `entered_after` + 1 (0: before its steps); a round set
    aside is published at the first step boundary after that, or before the next round's."""
    published: list[int] = []
    aside: int | None = None
    steps = 3
    for r, may_set_aside in enumerate(may, start=1):
        for step in range(1, steps + 1):  # the step boundaries of round r
            entered = r > entered_after + 1 or (
                r == entered_after + 1 and step > entered_at_step[r - 1]
            )
            if aside is not None and entered:
                published.append(aside)
                aside = None
        entered = r > entered_after
        end = round_end(
            caught_up=entered, aside_waiting=aside is not None, may_set_aside=may_set_aside
        )
        if end == "set_aside":
            aside = r
            continue
        if aside is not None:  # published first, once the swarm is entered (waited for)
            published.append(aside)
            aside = None
        published.append(r)
        assert end == "publish" or not entered  # a round waits only while not entered
    if aside is not None:  # the node stops: the round set aside goes out first
        published.append(aside)
    assert published == list(range(1, len(may) + 1))
