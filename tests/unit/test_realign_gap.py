"""dht.realign's gap: updates lost here that a live peer applied and no longer holds are
fetched by no one, so the replica takes a peer's state once summaries named them long enough
(bench.scale N = 16: one replica ended 3 updates short of the other 15's applied set)."""

from __future__ import annotations

import hashlib

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.catchup import CatchUp, CatchUpConfig
from dht.heartbeat import Heartbeat
from dht.realign import Realign, RealignConfig, RealignPolicy

PERIOD_S = 1.0


def beat(name: str, applied: str, records: dict[str, int], serves_state: bool = True) -> Heartbeat:
    return Heartbeat(
        peer_id=name, applied_digest=hashlib.sha256(applied.encode()).hexdigest(),
        sketch=[1.0, 2.0, 3.0], latest_seq=40,
        merged_by_author=records, num_applied=sum(records.values()), serves_state=serves_state,
    )  # fmt: skip


RECORDS = {"node0": 10, "node1": 12, "node2": 10, "node4": 10}


def policy_after(now: float, **config: object) -> RealignPolicy:
    """node4's policy, its applied set apart from the three others' (who agree), fed once."""
    p = RealignPolicy(RealignConfig(period_s=PERIOD_S, **config), "node4")  # type: ignore[arg-type]
    observe(p, now)
    return p


def observe(p: RealignPolicy, now: float, serves: bool = True) -> None:
    peers = [beat(n, "swarm", RECORDS, serves_state=serves) for n in ("node0", "node1", "node2")]
    p.observe(beat("node4", "short", RECORDS), peers, now)


def test_a_gap_named_for_gap_periods_takes_the_heaviest_namers_state() -> None:
    p = policy_after(0.0)
    p.note_gap("node0", 3, 0.0)
    p.note_gap("node1", 3, 1.0)
    assert p.decide(2.0) is None  # named 2 periods: another summary may still name a holder
    observe(p, 3.0)
    assert p.decide(3.0) == Realign("node1", 0.0, gap=3)  # node1: the heaviest record


def test_a_summary_naming_nothing_lost_clears_that_peer() -> None:
    p = policy_after(0.0)
    p.note_gap("node0", 3, 0.0)
    p.note_gap("node0", 0, 1.0)  # revived and fetched (or never lost): nothing to take
    observe(p, 5.0)
    assert p.decide(5.0) is None


def test_a_namer_without_a_record_here_or_that_serves_no_state_is_no_donor() -> None:
    p = policy_after(0.0)
    p.note_gap("stranger", 3, 0.0)  # a key with no applied updates here: not a participant
    observe(p, 5.0)
    assert p.decide(5.0) is None
    q = RealignPolicy(RealignConfig(period_s=PERIOD_S), "node4")
    observe(q, 0.0, serves=False)
    q.note_gap("node0", 3, 0.0)
    observe(q, 5.0, serves=False)
    assert q.decide(5.0) is None


def test_a_gap_realignment_spends_the_realignments_cap_and_a_load_clears_it() -> None:
    p = policy_after(0.0, max_attempts=1)
    p.note_gap("node2", 1, 0.0)
    observe(p, 3.0)
    decision = p.decide(3.0)
    assert decision == Realign("node2", 0.0, gap=1)
    p.started(3.0)
    p.finished(loaded=False)
    p.note_gap("node2", 1, 4.0)
    observe(p, 100.0)
    assert p.decide(100.0) is None  # the cap (1 per window) is spent
    r = policy_after(0.0)
    r.note_gap("node2", 1, 0.0)
    r.started(3.0)
    r.finished(loaded=True)  # a new applied set: the next summaries say what is left
    observe(r, 200.0)
    assert r.decide(200.0) is None


@settings(max_examples=60, deadline=None)
@given(names=st.lists(st.text("abcdef", min_size=1, max_size=3), min_size=1, max_size=200))
def test_gaps_kept_stay_bounded_whoever_names_them(names: list[str]) -> None:
    p = policy_after(0.0)
    for i, name in enumerate(names):
        p.note_gap(name, 1, float(i))
    assert len(p._gaps) <= p.config.max_participants


class Applied:
    def __init__(self, ids: set[tuple[str, int]]) -> None:
        self.ids = ids

    def has_applied(self, author: str, seq: int) -> bool:
        return (author, seq) in self.ids


def test_catchup_counts_lost_updates_a_peer_applied_and_does_not_hold() -> None:
    config = CatchUpConfig(lost_after_s=1.0)
    catchup = CatchUp(config, "me", Applied(set()))
    catchup.announced("a", 1, None, 0.0, holder="h")
    catchup.announced("a", 2, None, 0.0, holder="h")
    catchup.declare_lost(0.0, alive=set())
    assert sorted(catchup.declare_lost(2.0, alive=set())) == [("a", 1), ("a", 2)]
    learned = catchup.summary("p", {"a": [(1, 3)]}, {}, 3.0)  # applied a/1-3, holds none
    assert learned.num_unreachable == 2  # a/3 was never lost here: wanted, not a gap
    again = catchup.summary("q", {"a": [(1, 2)]}, {"a": [(2, 2)]}, 4.0)  # q holds a/2
    assert again.num_unreachable == 1  # a/2 is revived (q holds it); a/1 is still a gap
