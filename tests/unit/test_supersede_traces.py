"""A superseded group variant leaves nothing behind in what weighs later updates
(merge.weighing_journal, docs/scale.md session 23): a replica that applied the lesser variant
of a group round, then learned the pair's proof and stepped the prevailing one, holds the
robust window, the learner floor, the contribution ledger, the progress, the co-signer
credit and the applied set of a replica that only ever applied the prevailing variant, bit
for bit, where those windows sit near their thresholds; and so sizes every later update
alike."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from merge.budget_config import BudgetConfig
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.robust import RobustConfig
from tests.factories import identity, sealed_update
from tests.unit.test_group_equivocation import DELAYED, THE_RUN, UID, _pipeline, _retained
from tests.unit.test_group_merge import CONFIG, IDS, NUMEL, _update
from tests.unit.test_group_supersede import PAIRS, _proof

# Windows near their thresholds: a short robust window that warms up within the history,
# budgets that cut, records that establish authors within a few updates. The momentum checks
# are off: the prevailing variant steps in the lesser's slot, so the momentum it is judged
# against differs from a fresh replica's by its tail (DESIGN.md's consistency model), which
# is not what this test is about.
ROBUST = RobustConfig(
    window=3, warmup=2, max_norm_to_median=1.5, min_cosine=-1.0, center_radius=0.0,
    fresh_center_radius=0.0,
    budget=BudgetConfig(budget_rounds=2.0, fresh_share=1.0, cohort_share=1.0, min_record=1.5,
                        min_tenure=1.0, trust_rounds=2.0),
)  # fmt: skip
CONFIGS = [dataclasses.replace(c, robust=ROBUST) for c in (DELAYED, CONFIG)]
SOLO = [identity(f"solo{i}") for i in range(3)]

SOLO_EVENT = st.tuples(st.just("solo"), st.integers(0, 2), st.floats(0.2, 6.0), st.integers(1, 4))
GROUP_EVENT = st.tuples(st.just("group"), st.integers(2, 4), st.floats(0.2, 6.0), st.integers(0, 1))
HISTORY = st.lists(st.one_of(SOLO_EVENT, GROUP_EVENT), max_size=6)


class _History:
    """Turns drawn events into updates, each id once (solo seqs, group rounds 3 and up)."""

    def __init__(self) -> None:
        self.seqs = [0] * len(SOLO)
        self.round = 3
        self.clock = 1.0

    def updates(self, events: list[tuple[str, int, float, int]]) -> list[object]:
        made: list[object] = []
        for kind, which, scale, extra in events:
            self.clock += 1.0
            if kind == "solo":
                delta = torch.linspace(0.01, 0.02, NUMEL) * scale
                made.append(
                    sealed_update(
                        SOLO[which],
                        delta=delta,
                        seq=self.seqs[which],
                        learners=extra,
                        created_at=self.clock,
                    )  # fmt: skip
                )
                self.seqs[which] += 1
            else:
                members = IDS[extra : extra + which] if extra + which <= 4 else IDS[:which]
                made.append(_update(members, round_=self.round, scale=scale))
                self.round += 1
        return made


def _feed(pipeline: UpdatePipeline, updates: list[object]) -> list[tuple[object, ...]]:
    """Each update merged; what was decided about it (weight, learners, robust verdict)."""
    decided = []
    for update in updates:
        if hasattr(update, "aggregate"):
            r = pipeline.submit_group(update, THE_RUN.members_of(UID[0]))  # type: ignore[arg-type]
        else:
            r = pipeline.submit(update)  # type: ignore[arg-type]
        decided.append((r.accepted, r.reason, r.weight, r.learners, r.robust))
    return decided


def _weighing(pipeline: UpdatePipeline) -> dict[str, object]:
    """Every field that weighs a later update, as plain values."""
    replica = pipeline.replica
    return {
        "robust": pipeline.robust.state_dict(),
        "floor": pipeline.learner_floor.state_dict(),
        "ledger": pipeline.ledger.state_dict(),
        "credited": replica.state_dict()["num_credited"],
        "cosigned": replica.cosigned.counts(),
        "applied": replica.applied,
    }


@settings(max_examples=30, deadline=None)
@given(
    pair=st.sampled_from(sorted(PAIRS)),
    config=st.sampled_from(CONFIGS),
    prefix=HISTORY,
    suffix=HISTORY,
    held=st.booleans(),
    proof_first=st.booleans(),
)
def test_lesser_then_prevailing_holds_the_state_of_prevailing_alone(
    pair: str,
    config: MergeConfig,
    prefix: list[tuple[str, int, float, int]],
    suffix: list[tuple[str, int, float, int]],
    held: bool,
    proof_first: bool,
) -> None:
    """Replica `lesser_first`: the prefix, the lesser variant, (the prevailing one, refused
    and held, when `held`), the proof, the prevailing one, the suffix. Replica `fresh`: the
    prefix, (the proof, when `proof_first`), the prevailing variant, the suffix. They end
    bit-identical in the robust window, floor, ledger, progress, co-signer credit and applied
    set, decide every suffix update alike, and settle to the same params."""
    kept, lesser = PAIRS[pair]
    proof = _proof(kept, lesser)
    history = _History()
    before, after = history.updates(prefix), history.updates(suffix)
    lesser_first, fresh, untraced = _pipeline(config), _pipeline(config), _pipeline(config)
    untraced.weighing.attach()  # journals nothing: the lesser's records stay (as before)
    for pipeline in (lesser_first, fresh, untraced):
        _feed(pipeline, before)
    for pipeline in (lesser_first, untraced):
        _feed(pipeline, [lesser] + ([kept] if held else []))
        applied = lesser if pipeline.replica.has_applied(*UID) else None
        pipeline.learn_group_proof(proof, _retained(applied))
        if pipeline.equivocation.awaiting():
            _feed(pipeline, [kept])
    if proof_first:
        fresh.learn_group_proof(proof, _retained(None))
    _feed(fresh, [kept])
    if not proof_first:
        fresh.learn_group_proof(proof, _retained(kept))
    assert _weighing(lesser_first) == _weighing(fresh)
    decided = _feed(fresh, after)
    assert _feed(lesser_first, after) == decided
    assert _weighing(lesser_first) == _weighing(fresh)
    # How often the lesser's records, had they stayed, would have mattered (statistics).
    event(f"records kept would change a later decision: {_feed(untraced, after) != decided}")
    # The params: the same settled point (drift's measure). The prevailing variant's step
    # sits in the lesser's slot, so where that slot's round folded already it reaches the
    # momentum at the next fold (merge.outer take_back): a momentum tail, as arrival order.
    everywhere = torch.arange(NUMEL)
    torch.testing.assert_close(
        lesser_first.replica.settled_at(everywhere), fresh.replica.settled_at(everywhere),
        rtol=1.3e-6, atol=1e-5,
    )  # fmt: skip
