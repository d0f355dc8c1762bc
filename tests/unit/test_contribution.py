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
    # progress) over the 30 rounds and the budget's initial room; its record is short, so
    # its cap is still near one fair share (an honest author's 30 updates), not max_share.
    cap = ledger.cap("mallory")
    assert cap <= 1 + 3 * 30 / BudgetConfig().trust_rounds  # tenure: 30 rounds at most
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
    bound = ledger.cap("mallory") / (M - 1) * (config.budget_rounds + honest_rounds)
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
        {
            "total": 1.0,
            "accounts": [["a", 1.5, 0.0, 0.4, 1.0, 0.0]],
        },  # load above what it was credited
        {"total": 1.0, "accounts": [["a", 0.1, 0.0, 0.5, 0.2, 0.0]]},  # shares above its updates
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
