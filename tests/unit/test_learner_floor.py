"""The floor under a signed learner count: a low claim buys no more than an honest one."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.learners import LearnerFloor, credited_learners
from tests.factories import identity
from tests.unit.test_merge_pipeline import ALICE, BOB, make_pipeline, make_update

CAROL = identity("c")


def floor_after(history: list[tuple[str, int]], window: int = 256) -> LearnerFloor:
    floor = LearnerFloor(window)
    for author, claim in history:
        floor.applied(author, claim)
    return floor


def test_honest_claims_of_one_swarm_are_kept() -> None:
    floor = floor_after([(a, 3) for _ in range(4) for a in "abc"])
    assert [floor.effective(a, 3) for a in "abc"] == [3, 3, 3]
    assert floor.effective("newcomer", 1) == 3  # sized like the others from its first update


def test_a_liar_claiming_one_learner_is_sized_like_the_others() -> None:
    floor = floor_after([("a", 3), ("b", 3), ("liar", 1)] * 3)
    assert floor.effective("liar", 1) == 3
    assert floor.effective("a", 3) == 3  # the liar's low claim does not lower anyone


def test_a_minority_claiming_huge_counts_does_not_dilute_honest_updates() -> None:
    floor = floor_after([("a", 3), ("b", 3), ("c", 3), ("liar", 1024)] * 2)
    assert floor.effective("a", 3) == 3


def test_the_floor_never_exceeds_the_authors_seen() -> None:
    floor = floor_after([("liar", 1024)] * 5)  # one honest node beside one liar
    assert floor.effective("honest", 2) == 2


def test_authors_leave_the_window() -> None:
    floor = floor_after([("a", 4), ("b", 4), ("c", 4)] + [("d", 1), ("e", 1)] * 3, window=6)
    assert floor.floor("x") == 1  # a, b and c are out of the last 6 updates


def test_no_history_no_floor() -> None:
    assert LearnerFloor().effective("a", 1) == 1
    with pytest.raises(ValueError):
        LearnerFloor(0)


history = st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(1, 64)), max_size=40)


@settings(max_examples=100, deadline=None)
@given(history, st.sampled_from("abcdefg"), st.integers(1, 64), st.integers(1, 16))
def test_floor_properties(events, author, claim, window) -> None:  # type: ignore[no-untyped-def]
    floor = floor_after(events, window)
    recent = events[-window:]
    others = [c for a, c in recent if a != author]
    effective = floor.effective(author, claim)
    assert effective >= claim  # a floor: claiming more always shrinks one's own update
    if effective > claim:  # raised: never beyond the authors seen nor the others' claims
        assert effective <= len({a for a, _ in recent} | {author})
        assert effective <= max(others)
    # Only the window's claims matter (replicas that applied the same recent updates agree),
    # not what came before it.
    assert floor.floor(author) == floor_after(recent, window).floor(author)


def test_a_low_claim_through_the_pipeline_moves_the_replica_no_more_than_an_honest_one() -> None:
    honest, lied = make_pipeline(), make_pipeline()
    for p in (honest, lied):
        for i, who in enumerate((ALICE, BOB) * 2):
            assert p.submit(make_update(who, seq=i, learners=3)).accepted
    before = honest.replica.params.clone()
    assert torch.equal(before, lied.replica.params)
    fair = honest.submit(make_update(CAROL, seq=1, learners=3))
    low = lied.submit(make_update(CAROL, seq=1, learners=1))
    assert fair.accepted and low.accepted and low.learners == 3
    assert torch.equal(honest.replica.params, lied.replica.params)


def test_recent_authors_are_those_of_the_last_updates() -> None:
    floor = floor_after([("a", 2), ("b", 2), ("c", 2), ("a", 2)])
    assert floor.recent_authors(2) == {"c", "a"}
    assert floor.recent_authors(10) == {"a", "b", "c"}
    assert LearnerFloor().recent_authors(4) == set()


def test_replicas_that_applied_the_last_claims_in_another_order_size_alike() -> None:
    """Around a crash two authors briefly claim 3 instead of 4. One replica applied a's low
    claim last, another b's: the authors' latest claims differ (a floor from them gave 4 on
    one replica and 3 on the other for the same update), their median claims do not."""
    steady = [(a, 4) for _ in range(20) for a in "abc"]
    one = floor_after([*steady, ("b", 4), ("a", 3)])
    other = floor_after([*steady, ("a", 3), ("b", 3)])
    assert one.effective("d", 3) == other.effective("d", 3) == 4


timed_history = st.lists(
    st.tuples(st.sampled_from("abcdef"), st.integers(1, 16), st.floats(0.0, 100.0)), max_size=60
)


@given(timed_history, timed_history, st.floats(0.0, 100.0), st.sampled_from("abcdefg"))
def test_a_late_update_is_sized_by_what_was_claimed_when_it_was_signed(
    before: list[tuple[str, int, float]],
    later: list[tuple[str, int, float]],
    signed_at: float,
    author: str,
) -> None:
    """One replica applied an update as soon as it was signed, another after claims signed
    later had arrived: both size it alike (a replica that got the newcomer's first update
    50 s late sized it by the founders' later claims of 4 learners, its peer by 3:
    tests/unit/test_arrival_order.py). Claims signed after it are not votes on it."""
    early = [e for e in before if e[2] <= signed_at]
    late = [(a, c, max(t, signed_at) + 1.0) for a, c, t in later]
    on_time, delayed = LearnerFloor(), LearnerFloor()
    for a, c, t in early:
        on_time.applied(a, c, t)
    for a, c, t in [*early, *late]:
        delayed.applied(a, c, t)
    for credited in (None, lambda a: a in "abc"):
        assert on_time.floor(author, credited, signed_at=signed_at) == delayed.floor(
            author, credited, signed_at=signed_at
        )
    restored = LearnerFloor()
    restored.load_state_dict(delayed.state_dict())
    assert restored.state_dict() == delayed.state_dict()
    assert restored.floor(author, signed_at=signed_at) == on_time.floor(author, signed_at=signed_at)


def test_a_checkpoint_of_the_earlier_format_loads() -> None:
    floor = LearnerFloor()
    floor.load_state_dict({"recent": ["a", "b", "a"], "claims": {"a": 3, "b": 2}})
    assert floor.state_dict() == {"recent": [["a", 3], ["b", 2], ["a", 3]]}
    with pytest.raises(ValueError):
        floor.load_state_dict({"recent": [["a", 0]]})
    with pytest.raises(ValueError):
        floor.load_state_dict({"recent": [["a", 2, float("nan")]]})
    assert floor.state_dict() == {"recent": [["a", 3], ["b", 2], ["a", 3]]}  # unchanged
    floor.load_state_dict({"recent": [["a", 3], ["b", 2, 10.0]]})  # untimed claims vote always
    assert floor.floor("c", signed_at=5.0) == 2  # a's claim, 2 authors seen
    assert floor.floor("c", signed_at=10.0) == 2


def test_after_the_swarm_shrinks_for_good_the_floor_follows_once_half_the_claims_do() -> None:
    steady = [(a, 3) for _ in range(20) for a in "abc"]
    outage = [(a, 2) for _ in range(15) for a in "ab"]  # c is down; a and b claim 2
    assert floor_after(steady + outage).effective("a", 2) == 3  # an outage moves nothing
    gone = [(a, 2) for _ in range(25) for a in "ab"]  # c left for good
    assert floor_after(steady + gone).effective("a", 2) == 2


@settings(max_examples=60, deadline=None)
@given(
    fresh=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 1024)), max_size=80),
    honest=st.integers(1, 6),
)
def test_fresh_keys_vote_and_count_as_one_cohort(fresh: list[tuple[int, int]], honest: int) -> None:
    """However many fresh keys claim whatever, the floor under an honest author's update is at
    most the established authors plus one (the cohort) and the live learner count is the
    established peers plus one; honest claims of the swarm's size are kept."""
    established = {f"h{i}" for i in range(honest)}
    history = [(a, honest) for _ in range(4) for a in sorted(established)]
    history += [(f"sybil{key}", claim) for key, claim in fresh]
    floor = floor_after(history)
    for author in established:
        assert floor.floor(author, established.__contains__) <= honest + 1
        assert floor.effective(author, honest, established.__contains__) <= honest + 1
    peers = established | {f"sybil{key}" for key, _ in fresh}
    assert credited_learners(peers, established.__contains__) == honest + bool(fresh)
    assert credited_learners(peers, None) == len(peers)  # nobody established: all count
