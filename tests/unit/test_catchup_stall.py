"""Time a node did not run does not count toward its catch-up waits (CatchUpConfig.stall_s).

Session 26's failure, replayed: node b took a's state early (a's seq 1), wanted a's seqs 3-5,
failed to fetch them once a had evicted them (retaining 2), and was stopped 12 s with a
(tests/swarm/test_restart_lost.py's SIGSTOP). Its first poll after waking counted them lost,
0.6 s before a's summary named them applied (so they would wait for a's state), and only then
did they wait for a state: `update_lost` before `update_needs_state`
(/work/runs26/suite26/ev_rl1, times below are seconds from that run's start)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.catchup import CatchUp, CatchUpConfig
from dht.catchup_next import MAX_NEWLY_STALLED
from dht.ranges import UpdateId

LOST_AFTER_S = 3.0
"""The swarm test's --gap-wait 3 (dht.gossip.catchup_config: lost_after_s)."""
STALL_S = 3.0
"""dht.gossip.catchup_config with --heartbeat-period 1: three periods."""
CONFIG = CatchUpConfig(
    lost_after_s=LOST_AFTER_S,
    retry_s=1.0,
    mismatch_grace_s=2.0,
    summary_period_s=2.0,
    stall_s=STALL_S,
)


class Applied:
    def __init__(self) -> None:
        self.ids: set[UpdateId] = set()

    def has_applied(self, author: str, seq: int) -> bool:
        return (author, seq) in self.ids


def poll(catchup: CatchUp, start: float, end: float, alive: set[str]) -> list[UpdateId]:
    """The pump's polls every 0.5 s from `start` to `end`: what they declared lost."""
    lost: list[UpdateId] = []
    now = start
    while now <= end:
        lost += catchup.declare_lost(now, alive)
        now += 0.5
    return lost


def replay(config: CatchUpConfig) -> tuple[CatchUp, list[UpdateId], list[UpdateId]]:
    """Node b's catch-up through the run: what it declared lost at its first poll after the
    stop (27.65 s), and what in all until 34 s."""
    applied = Applied()
    b = CatchUp(config, "b", applied)
    applied.ids.add(("a", 1))  # 7.83: a's state, a/1 applied
    poll(b, 7.9, 8.4, {"a"})
    applied.ids.add(("a", 2))  # 8.51
    b.summary("a", {"a": [(1, 2)]}, {"a": [(1, 2)]}, 9.26)  # the repair: a at a/2
    poll(b, 8.9, 9.4, {"a"})
    for seq, at in ((3, 9.71), (4, 10.96), (5, 12.15)):
        b.announced("a", seq, None, at)
    assert poll(b, 9.9, 15.4, {"a"}) == []
    for seq in (3, 4, 5):  # 15.57: a retains 6-7 only, "not held"
        b.failed(("a", seq), "a", 15.57, refused=True)
    applied.ids.add(("a", 6))  # 15.59; then a and b are stopped until 27.6
    at_wake = b.declare_lost(27.65, set())  # a's heartbeats 12 s old: not alive yet
    later = poll(b, 27.9, 28.2, {"a"})
    for at in (28.24, 30.24, 32.24):  # a's summaries every summary_period_s: a at a/8
        b.summary("a", {"a": [(1, 8)]}, {"a": [(7, 8)]}, at)  # a applied 1-8, holds 7-8
        later += poll(b, at + 0.16, at + 1.9, {"a"})
    return b, at_wake, at_wake + later


def test_a_node_woken_from_a_stall_waits_for_its_donors_summary_and_loses_none() -> None:
    b, at_wake, lost = replay(CONFIG)
    assert at_wake == [] and lost == [], "updates a applied are not lost"
    assert b.newly_need_state == [("a", 3), ("a", 4), ("a", 5)], "they wait for a's state"
    assert not b.lost and b.wanted() == [("a", 7), ("a", 8)]  # a holds those: fetched
    assert b.num_stalls == 1 and 12.0 < b.stalled_s < 12.5
    assert len(b.newly_stalled) == 1 and b.newly_stalled[0] == b.stalled_s, "reported once"


def test_gaps_within_stall_s_are_not_stalls_and_reports_are_bounded() -> None:
    b = CatchUp(CONFIG, "b", Applied())
    poll(b, 0.0, 10.0, set())
    b.declare_lost(10.0 + STALL_S, set())  # exactly stall_s: a slow poll, not a stall
    assert b.num_stalls == 0 and b.newly_stalled == []
    for k in range(1, 40):  # never reported (a caller that stopped reading them)
        b.declare_lost(10.0 + STALL_S + 4.0 * k, set())
    assert b.num_stalls == 39 and len(b.newly_stalled) == MAX_NEWLY_STALLED


def test_with_stall_s_off_the_woken_node_counts_them_lost_as_in_the_run() -> None:
    """The failure itself (stall_s 0: every gap counts, the rule before session 26)."""
    b, at_wake, lost = replay(CatchUpConfig(lost_after_s=LOST_AFTER_S, retry_s=1.0))
    assert at_wake == [("a", 3), ("a", 4), ("a", 5)] and lost == at_wake
    assert b.newly_need_state == [("a", 3), ("a", 4), ("a", 5)]  # 28.24: only after
    assert not b.lost


def test_a_stall_moves_on_an_update_waiting_for_a_state_too() -> None:
    """One waiting for a state is lost once no live peer named it for lost_after_s: a node
    stopped longer than that does not count it lost on waking, before any peer could name it."""
    applied = Applied()
    b = CatchUp(CONFIG, "b", applied)
    b.announced("a", 1, None, 0.0)
    b.failed(("a", 1), "a", 0.0, refused=True)
    b.summary("p", {"a": [(1, 1)]}, {}, 0.5)  # p applied it, holds it not
    assert poll(b, 0.0, 3.0, {"a", "p"}) == [] and b.newly_need_state == [("a", 1)]
    assert b.declare_lost(20.0, set()) == [] and ("a", 1) in b.state_wants  # 17 s stop
    assert b.declare_lost(20.5, set()) == [("a", 1)]  # named 3 s of running time ago


def test_a_real_loss_is_still_declared_after_a_stall() -> None:
    """Nobody applied it: lost after lost_after_s of running time, the stall left out."""
    b = CatchUp(CONFIG, "b", Applied())
    b.announced("a", 1, None, 0.0)
    b.failed(("a", 1), "a", 0.0, refused=True)
    assert poll(b, 0.0, 2.0, set()) == []
    assert b.declare_lost(30.0, set()) == []  # 28 s stop: 2 s of running time
    assert poll(b, 30.5, 30.5, set()) == []
    assert poll(b, 31.0, 31.0, set()) == [("a", 1)]


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("pruned"), st.integers(min_value=1, max_value=6)),
            st.tuples(st.just("step"), st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.5, 7.0, 12.0])),
        ),
        max_size=60,
    )
)
def test_only_running_time_counts_toward_a_loss_and_a_real_loss_is_declared(
    ops: list[tuple[str, object]],
) -> None:
    """Polls after each op; a gap over stall_s is a stall. An update no peer offers is declared
    lost exactly when lost_after_s of running time (gaps up to stall_s) passed since its last
    source failed, never counting a stall, and then only once."""
    b = CatchUp(CONFIG, "b", Applied())
    now = running = 0.0
    since: dict[UpdateId, float] = {}  # sourceless since, in running time
    declared: set[UpdateId] = set()
    b.declare_lost(now, set())
    for kind, arg in ops:
        if kind == "pruned":
            uid = ("a", int(arg))  # type: ignore[call-overload]
            if b.announced(*uid, None, now):
                b.failed(uid, "a", now, refused=True)
                since[uid] = running
        else:
            step = float(arg)  # type: ignore[arg-type]
            now += step
            running += step if step <= STALL_S else 0.0
        lost = b.declare_lost(now, set())
        assert not set(lost) & declared, "declared once"
        declared |= set(lost)
        for uid, at in since.items():
            assert (uid in declared) == (running - at >= LOST_AFTER_S), (uid, at, running)
