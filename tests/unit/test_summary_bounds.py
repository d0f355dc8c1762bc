"""Repair summaries cost what the receiver could plausibly lack, never what they name."""

from __future__ import annotations

import time
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.budget import PeerBudget
from dht.catchup import CatchUp, CatchUpConfig
from dht.ranges import iter_ids, to_ranges
from dht.summary_bounds import (
    SummaryLimits,
    plausible_missing,
    reduce_summary,
    take_ids,
)
from dht.transport import encode_request
from tests.unit.catchup_sim import SimNode

LIMITS = SummaryLimits()
AUTHORS = ["alice", "bob", "carol"]


def test_a_170_byte_summary_naming_two_million_ids_costs_bounded_time_and_memory() -> None:
    blob = encode_request(applied={"x" * 50: [[1, 2**20]]}, retained={"y" * 50: [[1, 2**20]]})
    assert len(blob) <= 170
    tracemalloc.start()
    started = time.perf_counter()
    reduced = reduce_summary(blob, own={}, ceilings={}, limits=LIMITS)
    catchup = CatchUp(CatchUpConfig(), "me", SimNode("me"))
    learned = catchup.summary("mallory", reduced.applied, reduced.retained, now=0.0)
    elapsed_s = time.perf_counter() - started
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed_s < 0.5 and peak < 2 << 20
    assert learned.num_new == LIMITS.seq_slack  # only what an unknown author could have added
    assert reduced.num_beyond == 2 * (2**20 - LIMITS.seq_slack)  # counted, not walked


def test_authors_whose_signed_seqs_are_huge_still_cost_at_most_the_caps() -> None:
    """A Sybil's authors may sign headers up to seq 2**40: their ids are capped, and counted."""
    named = {f"sybil-{i}": [(1, 2**40)] for i in range(1024)}
    ceilings = dict.fromkeys(named, 2**40)
    started = time.perf_counter()
    plausible = plausible_missing(named, {}, ceilings, LIMITS)
    assert time.perf_counter() - started < 0.5
    assert plausible.num_ids == LIMITS.max_ids
    assert plausible.num_over_cap == 1024 * 2**40 - LIMITS.max_ids


def test_what_this_node_applied_is_subtracted_without_walking_it() -> None:
    own = {"alice": [(1, 10**12)]}
    plausible = plausible_missing({"alice": [(1, 10**12 + 5)]}, own, {"alice": 10**12}, LIMITS)
    assert plausible.ranges == {"alice": [(10**12 + 1, 10**12 + 5)]}
    assert plausible.num_beyond == 0 and plausible.num_over_cap == 0


def test_an_honest_gap_within_the_known_seqs_is_wanted_whole() -> None:
    own = to_ranges({"alice": [1, 2, 5, 9], "bob": [1]})
    named = to_ranges({"alice": range(1, 11), "bob": [1, 2]})
    plausible = plausible_missing(named, own, {"alice": 10, "bob": 2}, LIMITS)
    assert set(iter_ids(plausible.ranges)) == {("alice", s) for s in (3, 4, 6, 7, 8, 10)} | {
        ("bob", 2)
    }


ids = st.sets(st.tuples(st.sampled_from(AUTHORS), st.integers(1, 120)), max_size=80)


@settings(max_examples=100, deadline=None)
@given(
    named=ids,
    own=ids,
    ceilings=st.dictionaries(st.sampled_from(AUTHORS), st.integers(0, 120)),
    limits=st.builds(
        SummaryLimits,
        max_ids=st.integers(0, 60),
        max_ids_per_author=st.integers(0, 40),
        seq_slack=st.integers(0, 30),
    ),
)
def test_what_is_kept_is_exactly_the_lowest_missing_ids_within_the_bounds(
    named: set[tuple[str, int]],
    own: set[tuple[str, int]],
    ceilings: dict[str, int],
    limits: SummaryLimits,
) -> None:
    def by_author(uids: set[tuple[str, int]]) -> dict[str, list[int]]:
        grouped: dict[str, list[int]] = {}
        for author, seq in uids:
            grouped.setdefault(author, []).append(seq)
        return grouped

    plausible = plausible_missing(
        to_ranges(by_author(named)), to_ranges(by_author(own)), ceilings, limits
    )
    kept = list(iter_ids(plausible.ranges))
    expected: list[tuple[str, int]] = []
    num_beyond = 0
    for author in sorted({a for a, _ in named}):
        top = ceilings.get(author, 0) + limits.seq_slack
        seqs = sorted(s for a, s in named if a == author)
        num_beyond += sum(s > top for s in seqs)
        missing = [(author, s) for s in seqs if s <= top and (author, s) not in own]
        room = min(limits.max_ids - len(expected), limits.max_ids_per_author)
        expected += missing[:room]
    assert kept == expected
    assert plausible.num_beyond == num_beyond
    lacking = sum(
        1 for a, s in named if s <= ceilings.get(a, 0) + limits.seq_slack and (a, s) not in own
    )
    assert plausible.num_over_cap == lacking - len(kept)


@settings(max_examples=40, deadline=None)
@given(
    st.dictionaries(
        st.text(min_size=1, max_size=4),
        st.lists(st.tuples(st.integers(0, 2**60), st.integers(0, 2**60)).map(sorted), max_size=20),
        max_size=20,
    ),
    st.dictionaries(st.text(min_size=1, max_size=4), st.integers(-5, 2**60)),
)
def test_any_ranges_even_overlapping_are_kept_within_the_caps(
    named: dict[str, list[tuple[int, int]]], ceilings: dict[str, int]
) -> None:
    plausible = plausible_missing(named, {}, ceilings, LIMITS)
    assert plausible.num_ids <= LIMITS.max_ids
    for author, runs in plausible.ranges.items():
        assert sum(hi - lo + 1 for lo, hi in runs) <= LIMITS.max_ids_per_author
        assert all(
            1 <= lo <= hi <= max(0, ceilings.get(author, 0)) + LIMITS.seq_slack for lo, hi in runs
        )


def test_malformed_summaries_raise_value_errors() -> None:
    for blob in (b"[", b"[]", b'{"applied": {"a": [[2, 1]]}}', b'{"applied": NaN}'):
        try:
            reduce_summary(blob, {}, {}, LIMITS)
        except ValueError:
            continue
        raise AssertionError(f"{blob!r} was accepted")


def test_take_ids_keeps_the_first_ones() -> None:
    ranges = {"a": [(1, 3), (7, 9)], "b": [(1, 5)]}
    assert take_ids(ranges, 5) == {"a": [(1, 3), (7, 8)]}
    assert take_ids(ranges, 0) == {}


def test_a_peers_budget_grants_part_of_a_large_ask_and_refills() -> None:
    budget = PeerBudget(rate_per_s=100.0, burst=1000)
    assert budget.take("mallory", 5000, 0.0) == 1000
    assert budget.take("mallory", 5000, 0.0) == 0
    assert budget.take("mallory", 5000, 1.0) == 100
    assert budget.take("honest", 10, 1.0) == 10


def test_one_peers_summaries_fill_only_its_share_of_the_wants() -> None:
    catchup = CatchUp(CatchUpConfig(max_wants=100, max_wants_per_peer=30), "me", SimNode("me"))
    learned = catchup.summary("mallory", {"m": [(1, 50)]}, {}, now=0.0)
    assert (learned.num_new, learned.num_capped) == (30, 20)
    assert catchup.summary("mallory", {"n": [(1, 5)]}, {}, now=0.0).num_new == 0
    assert catchup.summary("honest", {"a": [(1, 40)]}, {}, now=0.0).num_new == 30
    for seq in range(1, 11):
        catchup.fetched(("m", seq))  # settled: mallory's share has room again
    assert catchup.summary("mallory", {"n": [(1, 5)]}, {}, now=0.0).num_new == 5
    catchup.forget_peer("mallory")
    assert catchup.summary("mallory", {"o": [(1, 30)]}, {}, now=0.0).num_new == 30
