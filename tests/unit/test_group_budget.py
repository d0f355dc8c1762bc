"""Learner groups' updates under the contribution budget, charged to their co-signers
(merge.contribution `group_allowance` / `group_applied`, merge.group_pipeline; docs/scale.md,
session 21): honest groups are not held back across a regrouping, fresh keys ground into a
group buy no more than one fresh key, group keys of fresh members do not vote on the floor,
the whole path and the sharded round decide alike, and a newcomer that adopted a donor's
state (or a node restored from a checkpoint) decides as the donor does."""

from __future__ import annotations

import copy
import math
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.group_budget import Replica, founded, groups_of, key
from dht.grouping import group_key
from merge.contribution import FRESH, BudgetConfig, ContributionLedger, _fair
from merge.group_pipeline import floor_votes
from merge.group_update import ContributionHeader, GroupReduction, GroupUpdate, RoundFields
from merge.handover import HandoverError
from merge.identity import Identity
from merge.outer import OuterConfig, OuterKind, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica as ModelReplica
from merge.robust import RobustConfig
from merge.weighting import StalenessConfig, TokenWeightConfig
from tests.factories import FINGERPRINT
from tests.unit.shard_round_paths import (
    DIRECTION,
    NUMEL,
    RUN,
    _assert_alike,
    _by_shards,
    _everyone,
    _one_by_one,
)

POOL = [Identity.generate() for _ in range(8)]
TIGHT = BudgetConfig(
    max_share=1.5, budget_rounds=2.0, fresh_share=0.6, cohort_share=0.6, min_record=2.0,
    min_tenure=0.5, trust_rounds=4.0,
)  # fmt: skip
"""Budgets that bind within a few updates, so both paths decide cut updates and the
transitions (established, trusted, in the cohort) inside one test's history."""


# --- the pure ledger, composed as both paths compose it (bench.group_budget.Replica) ---


@settings(max_examples=15, deadline=None)
@given(
    size=st.integers(1, 4),
    bits=st.integers(1, 3),
    split=st.booleans(),
    before=st.integers(12, 30),
    seed=st.integers(0, 2**16),
)
def test_honest_groups_are_never_held_back_across_a_regrouping(
    size: int, bits: int, split: bool, before: int, seed: int
) -> None:
    """Every group key changes when the split's bits do; the members' accounts do not: any
    honest swarm (2-8 groups of 1-4 members, one update per group per round in any order)
    split or merged after 12-30 rounds keeps every update whole for 30 rounds after (the
    budget keyed by the group key allowed 0 from the second round: session 20)."""
    replica = Replica()
    members, ids, _ = founded(replica, size << bits, bits, before, seed)
    rng = random.Random(seed)
    after = groups_of(members, ids, bits + 1 if split or bits == 1 else bits - 1)
    for _ in range(30):
        for group in rng.sample(sorted(after), len(after)):
            # sized by the old claims for a while after a merge (the floor's lag, session 20)
            learners, allowance = replica.submit(group, after[group], len(after))
            assert learners >= len(after) and allowance == 1.0


def test_a_newcomer_beside_established_members_neither_holds_back_nor_waits() -> None:
    """A newcomer joins each of 8 established groups of 2: the (upper) median co-signer is
    established, so no update is cut, and each newcomer earns a whole update's record a round
    (established after min_record rounds, as a fresh solo key publishing every round)."""
    replica = Replica()
    members, ids, rng = founded(replica, 16, 3, 20, seed=5)
    groups = groups_of(members, ids, 3)
    newcomers = {g: f"new{i}" for i, g in enumerate(sorted(groups))}
    for round_ in range(12):
        for g in sorted(groups):
            _, allowance = replica.submit(g, [*groups[g], newcomers[g]], len(groups))
            assert allowance == 1.0
        established = sum(map(replica.ledger.is_established, newcomers.values()))
        assert established == (8 if round_ + 1 >= BudgetConfig().min_record else 0)


def _adversary(k: int, rate: int, rounds: int) -> tuple[float, list[float], list[float]]:
    """k fresh keys as one group beside 8 honest groups of 4, `rate` updates per honest round:
    (the share of rounds it moved the replica by, each key's record, the cohort's loads)."""
    replica = Replica()
    members, ids, _ = founded(replica, 32, 3, 24, seed=7)
    honest = groups_of(members, ids, 3)
    keys = [f"x{i:02d}" for i in range(k)]
    moved, loads, ledger = 0.0, [], replica.ledger
    for _ in range(rounds):
        for g in sorted(honest):
            replica.submit(g, honest[g], len(honest))
        for _ in range(rate):
            learners, allowance = replica.submit(key("1" * 9), keys, len(honest))
            moved += allowance / learners
            loads.append(ledger._room(FRESH, 0.0))  # minus the cohort's load
    return moved, [ledger.record(k) for k in keys], loads


@settings(max_examples=15, deadline=None)
@given(k=st.integers(2, 24), rate=st.integers(1, 6), rounds=st.integers(1, 12))
def test_fresh_keys_ground_into_one_group_buy_no_more_than_one_fresh_key(
    k: int, rate: int, rounds: int
) -> None:
    """An adversary's group of k fresh keys publishing `rate` updates per round moves the
    replica by no more, and earns its keys no more record towards being established in all
    (each key's record up to `min_record`), than one fresh key in its place: the cohort's
    budget, whatever k; the cohort's load never exceeds its cap. Once established, a key
    earns as any established co-signer (k = 2, rate 2, 11 rounds: 22.6 in all against one
    key's 22.0, both keys established after 16 updates where one key is after 8)."""
    moved, records, loads = _adversary(k, rate, rounds)
    one_moved, (one_record,), _ = _adversary(1, rate, rounds)
    assert moved <= one_moved + 1e-9
    limit = BudgetConfig().min_record
    assert sum(min(record, limit) for record in records) <= one_record + 1e-9
    cap = BudgetConfig().cohort_share * _fair(8, BudgetConfig().budget_rounds)
    assert all(-load <= cap + 1e-9 for load in loads)


@settings(max_examples=10, deadline=None)
@given(num_keys=st.integers(9, 24), rounds=st.integers(1, 3))
def test_group_keys_of_fresh_members_do_not_vote_on_the_floor(num_keys: int, rounds: int) -> None:
    """More group keys claiming one learner than there are honest groups (9 sufficed before,
    session 20): their members are fresh, so their keys vote no more than fresh solo keys;
    every liar and every honest group is sized by the honest groups' 8."""
    replica = Replica()
    members, ids, _ = founded(replica, 32, 3, 24, seed=9)
    honest = groups_of(members, ids, 3)
    liars = {key("1" * 6 + format(i, "06b")): [f"y{i:02d}"] for i in range(num_keys)}
    for _ in range(rounds):
        for g in sorted(liars):
            assert replica.submit(g, liars[g], 1)[0] == 8
        for g in sorted(honest):
            assert replica.submit(g, honest[g], 8)[0] == 8


def test_a_group_key_votes_while_most_of_its_cosigners_are_counted() -> None:
    """The majority of the co-sign ledger's members of a key decides: two established of
    three co-signers vote, one of three does not."""
    replica = Replica()
    members, ids, _ = founded(replica, 16, 3, 24, seed=11)
    replica.cosigned.credit(key("101010"), [members[0], members[1], "fresh"])
    replica.cosigned.credit(key("010101"), [members[2], "fresh1", "fresh2"])
    votes, cohort = floor_votes(replica.ledger, replica.cosigned.cosigners)
    assert votes(key("101010")) and not votes(key("010101")) and not cohort


def test_the_ledger_charges_members_alike_in_any_order() -> None:
    """Each co-signer is credited against the clock as it was before the update: the
    co-signers' order changes nothing (replicas get them in the update's order)."""
    a, b = ContributionLedger(), ContributionLedger()
    for seq in range(60):
        members = [f"m{i}" for i in range(5)] + ([f"late{seq % 3}"] if seq > 30 else [])
        members = members if seq % 2 else [f"n{i}" for i in range(3)]
        a.group_applied(members, 2, a.group_allowance(members, 2), 0.8)
        shuffled = random.Random(seq).sample(members, len(members))
        b.group_applied(shuffled, 2, b.group_allowance(shuffled, 2), 0.8)
        assert a.state_dict() == b.state_dict()
    assert a.any_established() and 0 < a.record("late0") < a.record("m0")


# --- the pipeline's two paths (merge.group_pipeline, merge.shard_round) ---


def _pipeline(kind: OuterKind = "delayed_nesterov") -> UpdatePipeline:
    config = MergeConfig(
        outer=OuterConfig(kind=kind, lr=0.7, momentum=0.9),
        staleness=StalenessConfig(kind="polynomial", a=0.5),
        token_weight=TokenWeightConfig(reference_tokens=1000),
        max_inner_steps=100,
        max_tokens_per_step=100,
        robust=RobustConfig(budget=TIGHT),
    )
    replica = ModelReplica(
        torch.linspace(1.0, 2.0, NUMEL), make_outer_optimizer(config.outer, NUMEL)
    )
    pipeline = UpdatePipeline(replica, config, FINGERPRINT)
    pipeline.run_id = RUN
    return pipeline


def _update(group: int, round_: int, members: tuple[int, ...], claim: int) -> GroupUpdate:
    """Group `group`'s update for `round_`, every one of `members` (indices into POOL)
    contributing and co-signing, claiming `claim` learners."""
    key_ = group_key(format(group, "03b"))
    ids = [POOL[i] for i in sorted(set(members))]
    reduction = GroupReduction(
        group_key=key_, epoch=0, round=round_, members=[m.peer_id for m in ids]
    )
    fields = RoundFields(
        run_id=RUN, group_key=key_, epoch=0, round=round_, learners=claim,
        base_applied=10, published_applied=10,
    )  # fmt: skip
    for m in ids:
        noise = torch.randn(NUMEL, generator=torch.Generator().manual_seed(round_ * 97 + group))
        tensor = 0.3 * (DIRECTION + 0.2 * noise / NUMEL**0.5)
        assert reduction.contribute(ContributionHeader.of(tensor, m, fields, 500), tensor)
    reduction.close()
    for m in ids:
        reduction.cosign(m.peer_id, m.sign(reduction.statement(m.peer_id)))
    assert isinstance(reduction.outcome, GroupUpdate)
    return reduction.outcome


groups_st = st.tuples(
    st.integers(0, 4),
    st.integers(0, 9),
    st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=3).map(tuple),
    st.sampled_from([3, 3, 3, 8]),
)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["nesterov", "delayed_nesterov"]),
    history=st.lists(groups_st, max_size=16),
    batch=st.lists(groups_st, min_size=1, max_size=6),
    parts=st.integers(1, 3),
)
def test_both_paths_decide_budget_cut_group_updates_alike(
    kind: OuterKind,
    history: list[tuple[int, int, tuple[int, ...], int]],
    batch: list[tuple[int, int, tuple[int, ...], int]],
    parts: int,
) -> None:
    """Tight budgets: members over their caps, fresh-led groups held to the cohort, members
    established and trusted part way. The round decided by parts ends as the whole path one
    by one: each update's allowance, outer step, result and every member's account."""
    a, b = _pipeline(kind), _pipeline(kind)
    for spec in history:
        update = _update(*spec)
        a.submit_group(update, _everyone)
        b.submit_group(update, _everyone)
    updates = [_update(*spec) for spec in batch]
    expected = _one_by_one(a, updates)
    results, _ = _by_shards(b, updates, parts)
    assert [(r.accepted, r.reason, r.learners) for r in results] == [
        (r.accepted, r.reason, r.learners) for r in expected
    ]
    for x, y in zip(results, expected, strict=True):
        assert math.isclose(x.weight, y.weight, rel_tol=1e-5, abs_tol=1e-9)
    _assert_alike(a, b)


def _cut_history() -> list[GroupUpdate]:
    """One group of two members publishing faster than its budget, beside two others."""
    return [
        _update(g, r, members, 3)
        for r in range(6)
        for g, members in ((0, (0, 1)), (1, (2, 3)), (2, (4, 5)))
    ] + [_update(0, r, (0, 1), 3) for r in range(6, 12)]


def test_a_round_of_budget_cut_updates_is_decided_alike() -> None:
    """Not only possible: the round by parts cuts the same updates as the whole path."""
    a, b = _pipeline(), _pipeline()
    for update in _cut_history():
        a.submit_group(update, _everyone)
        b.submit_group(update, _everyone)
    assert a.rejections["over_budget"] > 0
    batch = [_update(0, r, (0, 1), 3) for r in range(12, 15)] + [_update(1, 6, (2, 3), 3)]
    expected = _one_by_one(a, batch)
    results, plan = _by_shards(b, batch, 2)
    cut = [d.allowance for d in plan.decisions]
    assert min(cut) == 0 and 0 < max(cut) < 1 and any(d.weight > 0 for d in plan.decisions)
    assert [r.weight for r in results] == pytest.approx([r.weight for r in expected], rel=1e-5)
    _assert_alike(a, b)


def test_a_newcomer_that_adopted_the_state_charges_and_allows_alike() -> None:
    """The members' accounts travel in the merge state, checked against the co-sign ledger
    (merge.handover: members are no authors of the applied set): the newcomer allows and
    charges the next group updates as its donor does; so does a node restored from a
    checkpoint of the pipeline's and the replica's state."""
    donor, newcomer, restored = _pipeline(), _pipeline(), _pipeline()
    for update in _cut_history():
        donor.submit_group(update, _everyone)
    newcomer.adopt(donor.transfer_state())
    restored.replica.load_state_dict(donor.replica.state_dict())
    restored.load_state_dict(donor.state_dict())
    for update in [_update(0, r, (0, 1), 3) for r in range(12, 16)]:
        results = [p.submit_group(update, _everyone) for p in (donor, newcomer, restored)]
        assert len({(r.weight, r.learners) for r in results}) == 1
    assert donor.ledger.state_dict() == newcomer.ledger.state_dict()
    assert donor.ledger.state_dict() == restored.ledger.state_dict()


def test_a_donor_crediting_a_member_beyond_what_it_cosigned_is_refused() -> None:
    """A member's record is bounded by the group updates the co-sign ledger says it
    co-signed (and its own applied updates); an account of a key that neither applied nor
    co-signed anything is refused."""
    donor = _pipeline()
    for update in _cut_history()[:6]:
        donor.submit_group(update, _everyone)
    state: dict[str, Any] = donor.transfer_state()
    member = POOL[0].peer_id
    for row, error in ((4, "credits"), (0, "never applied")):
        forged = copy.deepcopy(state)
        accounts = forged["merge"]["ledger"]["accounts"]
        index = next(i for i, r in enumerate(accounts) if r[0] == member)
        if row == 4:
            accounts[index][4] = 3.0  # it co-signed 2 updates
        else:
            accounts[index][0] = "a stranger"
        with pytest.raises(HandoverError, match=error):
            _pipeline().adopt(forged)
    assert sum(donor.replica.cosigned.counts()[member].values()) == 2
