"""Updates a state brings are not lost (dht.catchup_state): a wanted update no live peer serves
that a live peer serving its state applied waits for that state; it is lost only once no such
peer names it any more."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.catchup import CatchUp, CatchUpConfig
from dht.catchup_state import StateWants
from dht.ranges import UpdateId

LOST_AFTER_S = 10.0
CONFIG = CatchUpConfig(lost_after_s=LOST_AFTER_S, retry_s=1.0)


class Applied:
    def __init__(self) -> None:
        self.ids: set[UpdateId] = set()

    def has_applied(self, author: str, seq: int) -> bool:
        return (author, seq) in self.ids


def restarted(seqs: range = range(1, 4)) -> tuple[CatchUp, Applied]:
    """A node that wants a's early updates, which a (alive) no longer retains."""
    applied = Applied()
    catchup = CatchUp(CONFIG, "me", applied)
    for seq in seqs:
        catchup.announced("a", seq, None, 0.0)
        catchup.failed(("a", seq), "a", 0.0, refused=True)  # "not held": pruned
    return catchup, applied


def test_updates_a_live_peer_applied_and_nobody_serves_wait_for_a_state_not_lost() -> None:
    catchup, applied = restarted()
    learned = catchup.summary("p", {"a": [(1, 3)]}, {}, 1.0)  # p applied a/1-3, holds none
    assert catchup.declare_lost(0.5, {"a", "p"}) == []
    assert catchup.declare_lost(LOST_AFTER_S + 0.5, {"a", "p"}) == []
    assert catchup.newly_need_state == [("a", 1), ("a", 2), ("a", 3)]
    assert catchup.num_need_state == 3 and not catchup.lost and catchup.num_wanted == 0
    again = catchup.summary("p", {"a": [(1, 3)]}, {}, LOST_AFTER_S + 1)
    assert learned.num_unreachable == 0 and again.num_unreachable == 3  # dht.realign's gap
    applied.ids |= {("a", 1), ("a", 2), ("a", 3)}  # the gap took p's state
    assert catchup.declare_lost(LOST_AFTER_S + 2, {"a", "p"}) == []
    assert catchup.num_need_state == 0 and catchup.state_wants.num_brought == 3
    assert not catchup.lost


def test_a_peer_that_serves_no_state_cannot_bring_them_so_they_are_lost() -> None:
    catchup, _ = restarted()
    catchup.summary("p", {"a": [(1, 3)]}, {}, 1.0, serves_state=False)
    catchup.declare_lost(0.5, {"a", "p"})
    assert sorted(catchup.declare_lost(LOST_AFTER_S + 0.5, {"a", "p"})) == [
        ("a", 1), ("a", 2), ("a", 3)
    ]  # fmt: skip
    assert catchup.num_need_state == 0


def test_once_no_live_peer_names_them_applied_they_are_lost() -> None:
    """The peers that applied them left, or took a state without them: a real loss."""
    catchup, _ = restarted(range(1, 2))
    catchup.summary("p", {"a": [(1, 1)]}, {}, 1.0)
    catchup.declare_lost(0.5, {"a"})
    assert catchup.declare_lost(LOST_AFTER_S + 0.5, {"a"}) == []  # named 9.5 s ago
    assert catchup.num_need_state == 1
    catchup.summary("q", {"a": [(1, 1)]}, {}, 8.0)  # named again: waits on
    assert catchup.declare_lost(8.0 + LOST_AFTER_S - 0.5, {"a"}) == []
    assert catchup.declare_lost(8.0 + LOST_AFTER_S, {"a"}) == [("a", 1)]
    assert catchup.lost == {("a", 1)} and catchup.num_need_state == 0


def test_an_update_declared_lost_that_a_peer_then_names_applied_waits_for_its_state() -> None:
    catchup, _ = restarted(range(1, 2))
    catchup.declare_lost(0.0, {"a"})
    assert catchup.declare_lost(LOST_AFTER_S, {"a"}) == [("a", 1)]
    learned = catchup.summary("p", {"a": [(1, 1)]}, {}, LOST_AFTER_S + 1)
    assert not catchup.lost and catchup.num_need_state == 1 and learned.num_unreachable == 1
    assert catchup.newly_need_state == [("a", 1)]


def test_a_holder_showing_up_makes_an_update_waiting_for_a_state_wanted_again() -> None:
    catchup, _ = restarted(range(1, 2))
    catchup.summary("p", {"a": [(1, 1)]}, {}, 1.0)
    catchup.declare_lost(0.5, {"a"})
    catchup.declare_lost(LOST_AFTER_S + 0.5, {"a", "p"})
    catchup.holders("a", 1, ["c"], 12.0)  # a holder record may be stale: not trusted for it
    assert catchup.num_need_state == 1 and catchup.num_wanted == 0
    catchup.summary("c", {"a": [(1, 1)]}, {"a": [(1, 1)]}, 13.0)  # c holds it now
    assert catchup.num_need_state == 0 and catchup.wanted() == [("a", 1)]
    assert [f.peer_id for f in catchup.next_fetches(13.0, {"c"})] == ["c"]


def test_state_wants_stay_bounded_and_forget_the_least_recently_named() -> None:
    wants = StateWants(max_ids=2)
    wants.note(("a", 1), 0.0)
    wants.note(("a", 2), 1.0)
    assert wants.named(("a", 1), 2.0)  # named again: now the most recent
    wants.note(("a", 3), 3.0)
    assert set(wants) == {("a", 1), ("a", 3)}
    with pytest.raises(ValueError, match="max_ids"):
        StateWants(max_ids=0)


# ---- properties ---------------------------------------------------------------------------

SEQS = st.integers(min_value=1, max_value=3)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("pruned"), SEQS),
        st.tuples(
            st.just("summary"),
            st.sampled_from(["p", "q"]),
            st.booleans(),
            st.frozensets(SEQS, max_size=3),
            st.frozensets(SEQS, max_size=1),
        ),
        st.tuples(st.just("apply"), SEQS),
        st.tuples(st.just("tick"), st.sampled_from([1.0, 3.0, 6.0, LOST_AFTER_S])),
    ),
    max_size=24,
)


def _ranges(seqs: frozenset[int]) -> dict[str, list[tuple[int, int]]]:
    return {"a": [(s, s) for s in sorted(seqs)]} if seqs else {}


@settings(max_examples=500, deadline=None)
@given(ops=OPS)
def test_nothing_a_live_state_server_named_applied_within_the_wait_is_declared_lost(
    ops: list[tuple],
) -> None:
    """Whatever the order of pruned updates, summaries, applies and time: an update
    is declared lost only when no peer serving state named it applied (and not held) within
    lost_after_s; one waiting for a state was named within it and is not applied; lost,
    waiting and wanted are apart."""
    applied = Applied()
    catchup = CatchUp(CONFIG, "me", applied)
    named_at: dict[UpdateId, float] = {}
    now, alive = 0.0, {"a", "p", "q"}
    for op in ops:
        kind = op[0]
        if kind == "pruned":  # announced, and its author no longer serves it
            catchup.announced("a", op[1], None, now)
            catchup.failed(("a", op[1]), "a", now, refused=True)
        elif kind == "summary":
            _, peer, serves, seqs, held = op
            catchup.summary(peer, _ranges(seqs), _ranges(held), now, serves_state=serves)
            if serves:
                named_at.update({("a", s): now for s in seqs - held})
        elif kind == "apply":
            applied.ids.add(("a", op[1]))
        else:
            now += op[1]
        for uid in catchup.declare_lost(now, alive):
            assert not applied.has_applied(*uid)
            assert now - named_at.get(uid, -1e18) >= LOST_AFTER_S, (uid, named_at, now)
        waiting = set(catchup.state_wants)
        for uid in waiting:
            assert now - named_at[uid] < LOST_AFTER_S and not applied.has_applied(*uid)
        assert not waiting & set(catchup.lost) and not waiting & set(catchup.wanted())
        assert not set(catchup.lost) & set(catchup.wanted())


@settings(max_examples=100, deadline=None)
@given(
    max_ids=st.integers(min_value=1, max_value=8),
    notes=st.lists(st.tuples(SEQS, st.floats(min_value=0, max_value=100)), max_size=40),
)
def test_state_wants_never_hold_more_than_their_bound(
    max_ids: int, notes: list[tuple[int, float]]
) -> None:
    wants = StateWants(max_ids)
    for seq, at in notes:
        wants.note(("a", seq), at)
        assert len(wants) <= max_ids
