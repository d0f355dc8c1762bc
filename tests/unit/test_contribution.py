"""Contribution budgets: however fast an author publishes, it gets about its fair share."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.contribution import BudgetConfig, ContributionLedger
from merge.pipeline import budgeted

HONEST = ("alice", "bob", "carol")
M = 3


def round_robin(ledger: ContributionLedger, rounds: int) -> list[float]:
    allowances = []
    for _ in range(rounds):
        for author in HONEST:
            allowances.append(ledger.allowance(author, M))
            ledger.applied(author, M, allowances[-1])
    return allowances


def flood(ledger: ContributionLedger, author: str, count: int, learners: int = M) -> float:
    """`count` updates of `author`; the update-equivalents credited to them."""
    credited = 0.0
    for _ in range(count):
        allowance = ledger.allowance(author, learners)
        ledger.applied(author, learners, allowance)
        credited += allowance
    return credited


def test_honest_learners_of_one_speed_keep_their_whole_share() -> None:
    assert round_robin(ContributionLedger(), 50) == [1.0] * 150


def test_a_trusted_learner_four_times_as_fast_keeps_its_whole_share() -> None:
    ledger = ContributionLedger()
    round_robin(ledger, 50)  # established for more than trust_rounds
    for _ in range(40):
        assert flood(ledger, "alice", 4) == 4.0
        assert flood(ledger, "bob", 2) == 2.0
        assert flood(ledger, "carol", 1) == 1.0


def test_a_flood_buys_no_more_than_a_bounded_share_of_each_round() -> None:
    ledger, config = ContributionLedger(), BudgetConfig()
    round_robin(ledger, 20)  # an established swarm
    credited = 0.0
    for _ in range(30):
        round_robin(ledger, 1)
        credited += flood(ledger, "mallory", 1000)
    # Its budget: its cap (in fair shares: M / (M - 1) updates per round of the others'
    # progress) over the 30 rounds and the budget's initial room. Its tenure is 30 rounds of
    # the others at most (45 of the swarm), so its cap grew at most that far to max_share.
    cap = ledger.cap("mallory", M)
    tenure = 30 * M / (M - 1)
    assert cap <= 1.5 + (config.max_share - 1.5) * min(1.0, tenure / config.trust_rounds)
    assert credited <= cap * M / (M - 1) * (30 + config.budget_rounds) + 1e-6
    assert credited >= 30  # and it is not shut out: a newcomer earns a record


def test_many_fresh_keys_share_one_budget() -> None:
    ledger = ContributionLedger()
    round_robin(ledger, 20)
    sybils = [f"sybil{i}" for i in range(40)]
    while_fresh = 0.0
    for _ in range(10):
        round_robin(ledger, 1)
        for sybil in sybils * 5:
            allowance = ledger.allowance(sybil, M)
            if not ledger.is_established(sybil):
                while_fresh += allowance
            ledger.applied(sybil, M, allowance)
    # Together they got fresh_share fair shares while fresh (1.5 updates a round each, plus
    # the cohort's initial room), and each key that earned a record paid min_record of it.
    fresh = BudgetConfig().fresh_share
    assert while_fresh <= fresh * M / (M - 1) * (10 + BudgetConfig().budget_rounds) + 1e-6
    established = sum(ledger.is_established(s) for s in sybils)
    assert established <= while_fresh / BudgetConfig().min_record


def test_a_track_record_is_earned_by_credited_updates() -> None:
    ledger = ContributionLedger()
    round_robin(ledger, 3)
    assert not ledger.is_established("alice")  # 3 of min_record 8
    round_robin(ledger, 5)
    assert ledger.is_established("alice") and ledger.record("alice") == 8.0
    assert not ledger.is_established("") and ledger.record("newcomer") == 0.0


def test_without_a_budget_everything_counts() -> None:
    ledger = ContributionLedger(BudgetConfig(max_share=0.0))
    round_robin(ledger, 10)
    assert flood(ledger, "mallory", 500) == 500.0


@settings(max_examples=80, deadline=None)
@given(
    bursts=st.lists(st.tuples(st.integers(0, 40), st.sampled_from([3, 4, 64, 1024])),
                    min_size=1, max_size=25),
    warm=st.integers(8, 40),
)  # fmt: skip
def test_honest_shares_stay_whole_and_one_author_stays_bounded(
    bursts: list[tuple[int, int]], warm: int
) -> None:
    """For any sequence of one author's updates interleaved with honest rounds: every honest
    update keeps its whole share (as with no adversary), and the author's credited shares stay
    under its cap / (M - 1) of the honest progress plus its initial room (its cap only grows
    with its tenure, so the final one bounds them all). The swarm is established (`warm`
    rounds, at least min_record) when the stranger arrives; its claims are at least the
    swarm's size, as the pipeline's learner floor makes them."""
    config = BudgetConfig()
    ledger = ContributionLedger(config)
    assert round_robin(ledger, warm) == [1.0] * (M * warm)
    credited_rounds = 0.0
    for count, learners in bursts:
        assert round_robin(ledger, 1) == [1.0] * M
        for _ in range(count):
            allowance = ledger.allowance("mallory", learners)
            assert 0.0 <= allowance <= 1.0
            ledger.applied("mallory", learners, allowance)
            credited_rounds += allowance / learners
    honest_rounds = len(bursts)  # M updates of 1/M each per round
    bound = ledger.cap("mallory", M) / (M - 1) * (config.budget_rounds + honest_rounds)
    assert credited_rounds <= bound + 1e-6


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.integers(1, 8)), max_size=60))
def test_the_state_round_trips_through_json(events: list[tuple[str, int]]) -> None:
    ledger = ContributionLedger()
    for author, learners in events:
        ledger.applied(author, learners, ledger.allowance(author, learners))
    restored = ContributionLedger()
    restored.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.state_dict() == ledger.state_dict()
    for author in "abcde":
        assert restored.allowance(author, 3) == ledger.allowance(author, 3)


@pytest.mark.parametrize(
    "state",
    [
        None,
        {"total": -1.0, "accounts": []},
        {"total": math.inf, "accounts": []},
        {"total": 1.0, "accounts": [["a", 0.1, 0.0, 1.5, 2.0, 0.0]]},  # own above the clock
        {"total": 1.0, "accounts": [["a", 0.1, 1.5, 0.2, 1.0, 0.0]]},  # its clock ahead of it
        {"total": 1.0, "accounts": [["a", 0.1, 0.0, 0.2, 1.0]]},
        {"total": 1.0, "accounts": [["a", 0.1, 0.0, 0.2, 1.0, 0.0]] * 2},
        {"total": 1.0, "accounts": [["a", 0.1, 0.0, 0.2, 1.0, 2.0]]},  # first seen in future
        {"total": 1.0, "accounts": [[1, 0.1, 0.0, 0.2, 1.0, 0.0]]},
    ],
)
def test_a_malformed_state_is_refused_and_changes_nothing(state: object) -> None:
    ledger = ContributionLedger()
    round_robin(ledger, 2)
    before = ledger.state_dict()
    with pytest.raises(ValueError):
        ledger.load_state_dict(state)
    assert ledger.state_dict() == before


@pytest.mark.parametrize(
    "bad", [{"max_share": -1.0}, {"budget_rounds": 0.0}, {"min_record": math.nan}]
)
def test_bad_budget_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BudgetConfig(**bad)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    learners=st.integers(1, 1024),
    weight=st.floats(0.0, 4.0),
    allowance=st.floats(0.0, 1.0),
)
def test_a_budgeted_update_moves_and_advances_the_round_by_its_allowance(
    learners: int, weight: float, allowance: float
) -> None:
    """The pipeline applies `allowance` of an update as weight / learners' of a round: its
    move is the allowance's share of the move, and its progress through the round no more
    (a flood of tiny allowances must not fold the outer momentum every M updates)."""
    stepped, scaled = budgeted(learners, weight, allowance, 1024)
    assert 1 <= learners <= stepped <= 1024 or scaled == 0.0
    if scaled:
        assert scaled / stepped == pytest.approx(weight * allowance / learners, rel=1e-9)
        assert 1 / stepped <= allowance / learners * (1 + 1e-9) or allowance == 1.0


def test_an_honest_newcomer_at_the_swarms_pace_keeps_its_whole_share() -> None:
    ledger = ContributionLedger()
    round_robin(ledger, 20)
    for _ in range(30):
        round_robin(ledger, 1)
        assert flood(ledger, "newcomer", 1) == 1.0


SKEW_S = 600.0
"""The merge's max_clock_skew_s: receivers refuse updates dated further ahead of them."""
ALONE_AFTER_S = 3 * SKEW_S  # what the pipeline gives its ledger


class Clocked:
    """A ledger fed updates with the signed times (created_at) their authors put on them."""

    def __init__(self) -> None:
        self.ledger = ContributionLedger(alone_after_s=ALONE_AFTER_S)
        self.now = 1_000.0

    def publish(self, author: str, learners: int, dated: float = 0.0) -> float:
        """`author`'s update signed at now + `dated`; its allowance."""
        allowance = self.ledger.allowance(author, learners, self.now + dated)
        self.ledger.applied(author, learners, allowance, self.now + dated)
        return allowance


@settings(max_examples=40, deadline=None)
@given(count=st.integers(1, 2000), period_s=st.floats(0.01, 3600))
def test_a_lone_node_keeps_its_whole_share_forever(count: int, period_s: float) -> None:
    """A node alone sizes its updates by one learner: it is the swarm, and its budget never
    runs out however many updates it publishes (it ran out after 6 before)."""
    swarm = Clocked()
    for _ in range(count):
        swarm.now += period_s
        assert swarm.publish("alone", 1) == 1.0
    assert swarm.ledger.record("alone") == 0.0  # alone, it earns no one's trust


@settings(max_examples=40, deadline=None)
@given(rounds=st.integers(0, 60), period_s=st.floats(1, 600), after=st.integers(1, 500))
def test_a_node_whose_only_peer_died_keeps_training_at_full_weight(
    rounds: int, period_s: float, after: int
) -> None:
    """Its peer gone, a node's updates are still sized by two learners for a while (the learner
    floor remembers the peer): no one else's progress advances its budget's clock, so its
    updates were cut to nothing. Once its updates are signed `alone_after_s` after the peer's
    last one it is alone, and keeps its whole share from then on."""
    swarm = Clocked()
    for _ in range(rounds):
        swarm.now += period_s
        swarm.publish("alice", 2)
        swarm.publish("bob", 2)  # then bob dies
    last_of_bob = swarm.now
    while swarm.now - last_of_bob <= ALONE_AFTER_S:
        swarm.now += period_s
        swarm.publish("alice", 2)  # cut or not: within the budget's burst room
    for _ in range(after):
        swarm.now += period_s
        assert swarm.publish("alice", 2) == 1.0


@pytest.mark.parametrize(("speed", "early", "late"), [(3, 0.9, 1.0), (4, 0.7, 0.9)])
def test_an_honest_learner_faster_than_its_only_peer_keeps_most_of_its_share(
    speed: int, early: float, late: float
) -> None:
    """In a 2-node swarm a learner 3x (4x) as fast publishes 3 (4) updates per round of the
    other and needs a cap of 3 (4, max_share) fair shares. From the swarm's start it keeps
    `early` of what it publishes over the other's first 20 rounds (a newcomer's cap is 1.5
    until it is established), and `late` once trusted."""
    swarm, kept = Clocked(), []
    for _ in range(60):
        swarm.now += 30.0
        assert swarm.publish("slow", 2) == 1.0
        for _ in range(speed):
            swarm.now += 30.0 / speed
            kept.append(swarm.publish("fast", 2))
    assert sum(kept[: 20 * speed]) / (20 * speed) >= early
    assert sum(kept[-10 * speed :]) / (10 * speed) >= late


@settings(max_examples=60, deadline=None)
@given(
    bursts=st.lists(st.tuples(st.integers(0, 40), st.floats(-1e6, SKEW_S)), min_size=1,
                    max_size=25),
    round_s=st.floats(1, ALONE_AFTER_S - SKEW_S - 1),
)  # fmt: skip
def test_a_flooder_dating_its_updates_ahead_stays_capped(
    bursts: list[tuple[int, float]], round_s: float
) -> None:
    """However a flooder dates its updates (receivers refuse those more than max_clock_skew_s
    ahead of them), it cannot look alone while the honest authors publish more often than
    every alone_after_s - max_clock_skew_s: its credited share stays under its budget."""
    swarm, config = Clocked(), BudgetConfig()
    for _ in range(12):
        swarm.now += round_s
        assert [swarm.publish(author, M) for author in HONEST] == [1.0] * M
    credited_rounds = 0.0
    for count, dated in bursts:
        swarm.now += round_s
        assert [swarm.publish(author, M) for author in HONEST] == [1.0] * M
        for _ in range(count):
            credited_rounds += swarm.publish("mallory", M, dated) / M
    cap = swarm.ledger.cap("mallory", M)
    assert credited_rounds <= cap / (M - 1) * (config.budget_rounds + len(bursts)) + 1e-6


def test_an_author_of_zeros_loads_its_budget_without_record_and_its_state_still_loads() -> None:
    """Zero updates load their author's budget and earn no record (merge.robust.substance):
    a donor's or a checkpoint's ledger holding such an author must load as it was saved."""
    ledger = ContributionLedger()
    round_robin(ledger, 2)
    for _ in range(4):
        ledger.applied("zeros", 3, 1.0, evidence=0.0)
    saved = ledger.state_dict()
    restored = ContributionLedger()
    restored.load_state_dict(saved)
    assert restored.state_dict() == saved
    assert restored.record("zeros") == 0.0


def test_founders_keep_their_own_budgets_and_a_key_of_zeros_from_the_start_is_pooled() -> None:
    """Once the first author is established, the others are fresh, but a founder (credited
    from the swarm's first rounds, with substance) is not pooled in the fresh cohort and keeps
    its vote on the learner floor: which founder was established first follows the arrival
    order (bench.scale: one update sized by 4 learners on two replicas, 3 on two others). A
    key of zeros there from the first update on (no record: no substance) is pooled, and so
    is a newcomer."""
    ledger = ContributionLedger()
    ledger.applied("carol", M, 1.0, evidence=0.0)  # carol's first update earned no record
    ledger.applied("zeros", M, 1.0, evidence=0.0)
    while not ledger.any_established():
        for author in HONEST:
            ledger.applied(author, M, ledger.allowance(author, M))
            if ledger.any_established():
                break
        ledger.applied("zeros", M, ledger.allowance("zeros", M), evidence=0.0)
    assert not ledger.is_established("carol")  # a record of one update fewer
    assert not ledger.in_cohort("carol") and ledger.allowance("carol", M) == 1.0
    counted = ledger.individually_counted()  # a vote of its own on the learner floor
    assert counted("carol") and not counted("zeros")
    assert ledger.in_cohort("zeros")
    round_robin(ledger, 8)
    assert flood(ledger, "newcomer", 1) == 1.0 and ledger.in_cohort("newcomer")


@settings(max_examples=60, deadline=None)
@given(before=st.integers(1, 120), cut_off=st.integers(1, 60))
def test_a_home_cut_off_from_its_only_peer_keeps_a_burst_and_its_peer_s_late_updates_restore_both(
    before: int, cut_off: int
) -> None:
    """Two learners (M = 2); bob is cut off (a relay failover) for `cut_off` of alice's
    updates, then his `cut_off` updates of that time arrive late. alice's clock is the others'
    progress, which stops while only she is applied: her first 7 updates of the cut keep their
    whole share (7 in the swarm's first rounds, up to 24 once she is trusted: the burst room
    below her cap), later ones are cut to nothing in every replica that applies them before
    bob's (CI's "over its budget; 0 of it counts" at a home whose peer was unreachable for
    more updates than that; alone_after_s, 3x the clock skew, is far longer than a failover).
    A limit of the budget, not a lasting penalty: once bob's updates are applied, both keep
    whole shares again."""
    swarm = Clocked()
    for _ in range(before):
        swarm.now += 30.0
        assert [swarm.publish("alice", 2), swarm.publish("bob", 2)] == [1.0, 1.0]
    cut_at = swarm.now
    during = []
    for _ in range(cut_off):
        swarm.now += 30.0
        during.append(swarm.publish("alice", 2))
    assert during[:7] == [1.0] * min(7, cut_off)
    for i in range(cut_off):  # bob's, signed during the cut, applied after it
        allowance = swarm.ledger.allowance("bob", 2, cut_at + 30.0 * i)
        swarm.ledger.applied("bob", 2, allowance, cut_at + 30.0 * i)
    for _ in range(3):
        swarm.now += 30.0
        assert [swarm.publish("alice", 2), swarm.publish("bob", 2)] == [1.0, 1.0]
