"""Learner groups' updates sized by the learner floor (merge.group_pipeline, docs/scale.md
wiring plan step 5): a group claiming fewer learners than the other groups is sized by what
they claim, honest groups are sized by their own claim, solo and group authors share one
window, and replicas that applied the same updates in the same order size them alike, on
the whole path and the sharded round's."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import GROUP_KEY_PREFIX, group_key
from merge.group_update import (
    GROUP_AUTHOR_PREFIX,
    ContributionHeader,
    GroupReduction,
    GroupUpdate,
    RoundFields,
    is_group_author,
)
from merge.identity import Identity
from merge.pipeline import UpdatePipeline
from merge.result import MergeResult
from tests.factories import identity
from tests.unit.shard_round_paths import (
    NUMEL,
    RUN,
    Spec,
    _by_shards,
    _everyone,
    _pipeline,
    _tensor,
)
from tests.unit.test_merge_pipeline import make_update

MEMBERS = [Identity.generate() for _ in range(9)]


def _group(group: int, round_: int, claim: int, seed: int = 1, kind: str = "honest") -> GroupUpdate:
    """Group `group`'s (0-8; one member) update for `round_`, claiming `claim` learners."""
    member, key = MEMBERS[group], group_key(format(group, "04b"))
    reduction = GroupReduction(group_key=key, epoch=0, round=round_, members=[member.peer_id])
    fields = RoundFields(
        run_id=RUN, group_key=key, epoch=0, round=round_, learners=claim,
        base_applied=10, published_applied=10,
    )  # fmt: skip
    tensor = _tensor(Spec(group, round_, kind, 0, 0), seed)
    reduction.contribute(ContributionHeader.of(tensor, member, fields, 500), tensor)
    reduction.close()
    reduction.cosign(member.peer_id, member.sign(reduction.statement(member.peer_id)))
    assert isinstance(reduction.outcome, GroupUpdate)
    return reduction.outcome


def _submit(pipeline: UpdatePipeline, updates: list[GroupUpdate]) -> list[MergeResult]:
    return [pipeline.submit_group(u, _everyone) for u in updates]


def test_group_keys_are_the_groupings_keys_and_no_peer_id() -> None:
    assert f"{GROUP_KEY_PREFIX}.0b" == GROUP_AUTHOR_PREFIX
    assert is_group_author(group_key("0110")) and is_group_author(group_key(""))
    assert not is_group_author(identity("a").peer_id)


def test_a_group_claiming_one_learner_among_groups_claiming_eight_is_sized_by_eight() -> None:
    """Before the floor has votes a group is sized by its claim; once the other groups'
    claims are in the window, a claim of one is raised to theirs (1/8 of a round, not a whole
    outer step), and the honest groups are sized by their own claim, the liar's low claim
    lowering none of them."""
    pipeline = _pipeline("delayed_nesterov")
    first = pipeline.submit_group(_group(7, 0, 1), _everyone)
    assert first.accepted and first.learners == 1  # no votes yet: its own claim
    honest = _submit(pipeline, [_group(g, 0, 8) for g in range(7)])
    assert all(r.accepted and r.learners == 8 for r in honest)
    liar = pipeline.submit_group(_group(7, 1, 1), _everyone)
    assert liar.accepted and liar.learners == 8
    # the same tokens and staleness as an honest update: the same share of the round
    assert math.isclose(liar.weight, honest[0].weight)
    after = _submit(pipeline, [_group(g, 1, 8) for g in range(7)])
    assert all(r.learners == 8 for r in after)


def test_a_low_claim_moves_the_replica_no_more_than_an_honest_one() -> None:
    """The same update claiming one learner or eight, after the same history: the replica
    moves alike (a Nesterov step of 1/8 of a round)."""
    moved = []
    for claim in (8, 1):
        pipeline = _pipeline("nesterov")
        _submit(pipeline, [_group(g, 0, 8) for g in range(7)])
        before = pipeline.replica.params.clone()
        pipeline.submit_group(_group(7, 0, claim, seed=2), _everyone)
        moved.append(pipeline.replica.params - before)
    torch.testing.assert_close(moved[0], moved[1])


def test_a_solo_update_in_a_group_run_is_sized_by_the_groups_claims() -> None:
    """One window for solo and group authors: a peer publishing alone in a run of groups
    (no honest member does) is sized by the groups' claims, not by its own claim of one."""
    pipeline = _pipeline("delayed_nesterov")
    _submit(pipeline, [_group(g, 0, 8) for g in range(8)])
    solo = make_update(identity("solo"), [0.01] * NUMEL, learners=1, created_at=1.0)
    result = pipeline.submit(solo)
    assert result.accepted and result.learners == 8


def test_a_zeroed_group_update_takes_no_place_in_the_floor() -> None:
    """What moved the replica votes (as for solo updates): an update the robust checks zero
    (against the momentum) leaves the window as it was."""
    pipeline = _pipeline("delayed_nesterov")
    _submit(pipeline, [_group(g, 0, 8) for g in range(7)])
    before = pipeline.learner_floor.state_dict()
    against = _group(7, 0, 1, kind="against")
    result = pipeline.submit_group(against, _everyone)
    assert result.accepted and result.weight == 0 and result.robust == "against_momentum"
    assert pipeline.learner_floor.state_dict() == before


@settings(max_examples=40, deadline=None)
@given(
    num_groups=st.integers(2, 8),
    rounds=st.integers(1, 3),
    order=st.randoms(use_true_random=False),
)
def test_honest_groups_are_sized_by_their_own_claim(
    num_groups: int, rounds: int, order: object
) -> None:
    """Groups that all claim the epoch's count (the non-empty groups), in any order, are
    sized by it: the floor never moves an honest group update."""
    updates = [_group(g, r, num_groups) for r in range(rounds) for g in range(num_groups)]
    order.shuffle(updates)  # type: ignore[attr-defined]
    results = _submit(_pipeline("delayed_nesterov"), updates)
    assert all(r.accepted and r.learners == num_groups for r in results)


claims = st.lists(
    st.tuples(st.integers(0, 8), st.integers(0, 3), st.sampled_from([1, 1, 2, 8, 8, 8, 16])),
    min_size=1,
    max_size=14,
)


@settings(max_examples=40, deadline=None)
@given(history=claims, cut=st.integers(0, 14))
def test_replicas_that_applied_the_same_updates_in_order_size_them_alike(
    history: list[tuple[int, int, int]], cut: int
) -> None:
    """Two replicas applying one sequence of group updates (claims of 1 to 16, duplicates)
    size each update alike, and so does a replica restarted from the first one's checkpoint
    part way (the floor's window is saved with the group claims, no signed time)."""
    updates = [_group(g, r, c) for g, r, c in history]
    a, b = _pipeline("delayed_nesterov"), _pipeline("delayed_nesterov")
    restored = _pipeline("delayed_nesterov")
    ra, rb = _submit(a, updates[:cut]), _submit(b, updates[:cut])
    restored.replica.load_state_dict(a.replica.state_dict())
    restored.load_state_dict(a.state_dict())
    ra, rb = ra + _submit(a, updates[cut:]), rb + _submit(b, updates[cut:])
    rc = _submit(restored, updates[cut:])
    assert [(r.accepted, r.learners, r.weight) for r in ra] == [
        (r.accepted, r.learners, r.weight) for r in rb
    ]
    assert [(r.accepted, r.learners, r.weight) for r in rc] == [
        (r.accepted, r.learners, r.weight) for r in ra[cut:]
    ]
    assert a.learner_floor.state_dict() == restored.learner_floor.state_dict()


@settings(max_examples=40, deadline=None)
@given(
    num_groups=st.integers(3, 8),
    liar_claim=st.integers(1, 2),
    members=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_a_liar_in_a_round_decided_by_parts_is_sized_as_by_the_whole_path(
    num_groups: int, liar_claim: int, members: int, seed: int
) -> None:
    """A round of other groups' updates decided by parts (merge.shard_round), one of them
    claiming fewer learners than the groups before it: sized by the floor (the honest
    groups' claim, the round's earlier updates voting as they would one by one), with the
    same weight as on the whole path."""
    whole, parts = _pipeline("delayed_nesterov"), _pipeline("delayed_nesterov")
    history = [_group(g, 0, num_groups, seed) for g in range(num_groups)]
    _submit(whole, history)
    _submit(parts, history)
    batch = [_group(g, 1, num_groups, seed) for g in range(num_groups - 1)]
    batch.append(_group(8, 1, liar_claim, seed))
    expected = [whole.submit_group(u, _everyone) for u in sorted(batch, key=_uid)]
    results, _ = _by_shards(parts, batch, members)
    assert [(r.author, r.learners) for r in results] == [(r.author, r.learners) for r in expected]
    assert all(r.learners == num_groups for r in results)
    for x, y in zip(results, expected, strict=True):
        assert math.isclose(x.weight, y.weight, rel_tol=1e-5, abs_tol=1e-9)
    assert whole.learner_floor.state_dict() == parts.learner_floor.state_dict()


def _uid(update: GroupUpdate) -> tuple[str, int]:
    return update.head.group_key, update.seq


def test_a_newcomer_adopting_the_state_sizes_the_next_group_update_alike() -> None:
    """The floor's window with group claims travels with the state (merge.handover accepts
    group keys the replica applied): a liar's next update is sized alike on the donor and on
    the newcomer."""
    donor, newcomer = _pipeline("delayed_nesterov"), _pipeline("delayed_nesterov")
    _submit(donor, [_group(g, 0, 8) for g in range(7)])
    newcomer.adopt(donor.transfer_state())
    liar = _group(7, 0, 1)
    a, b = donor.submit_group(liar, _everyone), newcomer.submit_group(liar, _everyone)
    assert a.learners == b.learners == 8 and a.weight == b.weight
