"""The weighing journal (merge.weighing_journal): one update's records taken back out of the
robust window, the learner floor, the contribution ledger and the progress leave each
structure as if that update had never recorded anything, with every other update's records
in their order; past the journal's bound it answers False and changes nothing."""

from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from merge.budget_config import BudgetConfig
from merge.contribution import ContributionLedger
from merge.learners import LearnerFloor
from merge.robust import RobustConfig, RobustFilter, Verdict
from merge.weighing_journal import CreditedSum, WeighingJournal

AUTHORS = ["a", "b", "c", "d"]
BUDGET = BudgetConfig(budget_rounds=2.0, min_record=1.5, min_tenure=1.0, trust_rounds=2.0)
# (author, norm, claim, allowance, group?): what one applied update records.
UPDATE = st.tuples(
    st.sampled_from(AUTHORS),
    st.floats(0.1, 5.0),
    st.integers(1, 4),
    st.floats(0.0, 1.0),
    st.booleans(),
)


def _structures() -> tuple[RobustFilter, LearnerFloor, ContributionLedger, CreditedSum]:
    robust = RobustFilter(RobustConfig(window=3, warmup=2, max_norm_to_median=1.5))
    return robust, LearnerFloor(window=4), ContributionLedger(BUDGET), CreditedSum()


def _record(structures: tuple[object, ...], update: tuple[str, float, int, float, bool]) -> None:
    """What the pipeline records for one applied update (merge.pipeline, group_pipeline)."""
    robust, floor, ledger, credit = structures
    author, norm, claim, allowance, group = update
    assert isinstance(robust, RobustFilter) and isinstance(floor, LearnerFloor)
    assert isinstance(ledger, ContributionLedger) and isinstance(credit, CreditedSum)
    credit.add(allowance)
    if group:
        ledger.group_applied([author, "m1", "m2"], claim, allowance, 0.5)
    else:
        ledger.applied(author, claim, allowance, None, 1.0)
    robust.record(Verdict(None, norm, robust.median_norm(), None), author, flush=group)
    floor.applied(author, claim, None)


def _state(structures: tuple[object, ...]) -> list[object]:
    robust, floor, ledger, credit = structures
    assert isinstance(robust, RobustFilter) and isinstance(floor, LearnerFloor)
    assert isinstance(ledger, ContributionLedger) and isinstance(credit, CreditedSum)
    return [robust.state_dict(), floor.state_dict(), ledger.state_dict(), credit.total]


@settings(max_examples=80, deadline=None)
@given(updates=st.lists(UPDATE, min_size=1, max_size=14), data=st.data())
def test_taking_one_update_back_leaves_what_the_others_recorded(
    updates: list[tuple[str, float, int, float, bool]], data: st.DataObject
) -> None:
    """Evictions from the windows (robust window 3, floor window 4) and the ledger's decays
    included: the journaled structures equal structures that never recorded the update taken
    back, bit for bit. (Each update's robust verdict is the one it was recorded with: the
    journal replays records, it does not re-judge.)"""
    gone = data.draw(st.integers(0, len(updates) - 1))
    journal, live = WeighingJournal(), _structures()
    journal.attach(*live)
    verdicts = []
    for i, update in enumerate(updates):
        journal.tag = ("u", i)
        verdicts.append(live[0].median_norm())
        _record(live, update)
    assert journal.take_back(("u", gone))
    never = _structures()
    for i, update in enumerate(updates):
        if i != gone:
            robust, floor, ledger, credit = never
            author, norm, claim, allowance, group = update
            credit.add(allowance)
            if group:
                ledger.group_applied([author, "m1", "m2"], claim, allowance, 0.5)
            else:
                ledger.applied(author, claim, allowance, None, 1.0)
            robust.record(Verdict(None, norm, verdicts[i], None), author, flush=group)
            floor.applied(author, claim, None)
    assert _state(live) == _state(never)
    assert not journal.take_back(("u", gone))  # taken back once
    journal.tag = "later"
    _record(live, updates[0])  # the journal goes on from there
    _record(never, updates[0])
    assert _state(live) == _state(never)


def test_past_its_bound_or_after_a_load_an_update_is_not_taken_back() -> None:
    journal, live = WeighingJournal(max_ops=8), _structures()
    journal.attach(*live)
    for i in range(4):  # four ops each: the first update's are folded into the shadows
        journal.tag = i
        _record(live, ("a", 1.0 + i, 2, 1.0, False))
    before = _state(live)
    assert not journal.take_back(0) and _state(live) == before
    assert journal.take_back(3)  # the newest still is
    journal.tag = 4
    _record(live, ("b", 1.0, 2, 1.0, False))
    live[1].load_state_dict(live[1].state_dict())  # a checkpoint loaded: start again
    assert len(journal) == 0 and not journal.take_back(4)


def test_a_copy_is_outside_the_journal() -> None:
    """The sharded round decides on copies of these structures: what they record is not
    journaled, and the journal is not copied with them."""
    journal, live = WeighingJournal(), _structures()
    journal.attach(*live)
    copied = copy.deepcopy(live[0])
    assert copied.journal is None
    copied.record(Verdict(None, 1.0, None, None), "a")
    assert len(journal) == 0
