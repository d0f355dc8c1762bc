"""One member's side of a round merged as one linear step (merge.shard_member): members that
exchange their parts and slices end where applying the updates one by one does, each alike;
a member that sends a part or slices that fail their checks, or stands on another applied
set, makes the others fall back (nothing applied), never crash."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.realign_config import SETTLE_TOLERANCE
from merge.pipeline import UpdatePipeline
from merge.shard_member import MemberRound
from merge.shard_round import Incoming, ShardRound
from merge.sketch import ReplicaSketch, relative_distance
from tests.unit.shard_round_paths import (
    IDS,
    Spec,
    _assert_alike,
    _everyone,
    _history,
    _one_by_one,
    _pipeline,
    _update,
)
from tests.unit.test_shard_round_cap import _whole_step_then_near_cap

MEMBERS = sorted(identity.peer_id for identity in IDS[:3])


def _rounds(pipelines: list[UpdatePipeline], updates: list) -> list[MemberRound]:
    out = []
    for pipeline, me in zip(pipelines, MEMBERS, strict=True):
        rounds = ShardRound(pipeline.groups)
        incoming = [Incoming.of(pipeline.groups, u, _everyone) for u in updates]
        out.append(MemberRound(rounds, MEMBERS, me, incoming))
    return out


def _fetch(rounds: list[MemberRound]) -> None:
    for member in rounds:
        start, end = member.slice
        for i in member.needs():
            update = member.incoming[i].update
            assert update is not None
            assert member.fetched(i, update.aggregate[start:end].clone())


def _exchange_parts(rounds: list[MemberRound]) -> None:
    parts = {m.me: m.part() for m in rounds}
    for member in rounds:
        for other, part in parts.items():
            if other != member.me:
                member.part_from(other, part)


def _exchange_sums(rounds: list[MemberRound]) -> dict[str, list[torch.Tensor] | None]:
    for member in rounds:
        member.decide()
    sums = {m.me: m.sums() for m in rounds}
    for member in rounds:
        for other, slices in sums.items():
            if other != member.me and slices is not None:
                member.sums_from(other, slices)
    return sums


def _setup(fold: bool) -> tuple[list[UpdatePipeline], UpdatePipeline, list]:
    learners = 3 if fold else 16
    pipelines = [_pipeline("delayed_nesterov") for _ in range(4)]
    for pipeline in pipelines:
        _history(pipeline, 2)
    specs = [Spec(g, 1, "honest", 0, 0) for g in range(4)] + [Spec(5, 1, "big", 0, 0)]
    updates = [_update(spec, 3, learners) for spec in specs]
    return pipelines[:3], pipelines[3], updates


def test_members_that_exchange_parts_and_slices_end_as_applied_one_by_one() -> None:
    for fold in (False, True):
        members, reference, updates = _setup(fold)
        rounds = _rounds(members, updates)
        _fetch(rounds)
        _exchange_parts(rounds)
        _exchange_sums(rounds)
        results = [m.apply() for m in rounds]
        assert all(r is not None for r in results) and all(m.failed is None for m in rounds)
        plan = rounds[0].plan
        assert plan is not None and len(plan.combos) == 1  # cut at the fold: one sum
        decided = [d.incoming.update for d in plan.decisions]
        expected = _one_by_one(reference, [u for u in decided if u is not None])
        assert [r.accepted for r in results[0] or []] == [r.accepted for r in expected]
        _assert_alike(members[0], reference)
        for other in members[1:]:  # every member alike, bit for bit
            assert torch.equal(other.replica.params, members[0].replica.params)
            assert other.replica.applied == members[0].replica.applied
        if fold:
            assert plan.deferred  # the rest wait for the next round


def _group(updates: list, rounds_of: list[list[int]], *, bf16: bool = False) -> UpdatePipeline:
    """A group of three members applying `updates` in the rounds `rounds_of` (indices of
    each round's updates); `bf16`: each member rounds its slices of the sums to bf16 before
    it sends and applies them (sessions 20-23's wire). Its first member's pipeline."""
    members = [_pipeline("delayed_nesterov") for _ in MEMBERS]
    for pipeline in members:
        _history(pipeline, 2)
    for indices in rounds_of:
        rounds = _rounds(members, [updates[i] for i in indices])
        _fetch(rounds)
        _exchange_parts(rounds)
        for member in rounds:
            member.decide()
            mine = member.sums()
            if bf16 and mine is not None:  # what the member sent, and applied itself
                member._sums[member.me] = [t.bfloat16().float() for t in mine]
        for member in rounds:
            member._sums.update({m.me: m._sums[m.me] for m in rounds})
        assert all(m.apply() is not None and m.failed is None for m in rounds)
        for other in members[1:]:  # alike within the group, bit for bit
            assert torch.equal(other.replica.params, members[0].replica.params)
    return members[0]


def _settled_apart(a: UpdatePipeline, b: UpdatePipeline) -> float:
    """How far the settle (dht.realign_settle) sees the two replicas apart: the relative
    distance of their settled sketches."""
    assert a.replica.applied == b.replica.applied
    sketch = ReplicaSketch(a.replica.numel, "settle")
    distance = relative_distance(sketch.settled(a.replica), sketch.settled(b.replica))
    assert distance is not None
    return distance


def test_groups_applying_a_set_in_other_rounds_end_within_the_settle_tolerance() -> None:
    """Two groups apply the same five updates, one in one round, the other in two (and a
    third one by one, as a node that fetched them whole): with the sums in fp32 their
    replicas end within the settle's tolerance of each other (no state download at the end);
    with the sums rounded to bf16 (sessions 20-23) they do not."""
    _, reference, updates = _setup(False)
    updates = sorted(updates, key=lambda u: (u.head.group_key, u.seq))  # the rounds' id order
    tolerance = SETTLE_TOLERANCE
    one = _group(updates, [[0, 1, 2, 3, 4]])
    two = _group(updates, [[0, 1], [2, 3, 4]])
    _one_by_one(reference, updates)
    assert _settled_apart(one, two) <= tolerance
    assert _settled_apart(one, reference) <= tolerance
    assert _settled_apart(two, reference) <= tolerance
    one16 = _group(updates, [[0, 1, 2, 3, 4]], bf16=True)
    two16 = _group(updates, [[0, 1], [2, 3, 4]], bf16=True)
    assert _settled_apart(one16, two16) > 10 * tolerance
    assert _settled_apart(one16, reference) > 10 * tolerance


@settings(max_examples=12, deadline=None)
@given(cuts=st.sets(st.integers(1, 4)))
def test_any_split_into_rounds_ends_within_the_settle_tolerance_of_one_by_one(
    cuts: set[int],
) -> None:
    """Whatever rounds a group cuts the five updates into (consecutive in id order, as
    fetch rounds take them), with fp32 sums its replica ends within the settle's tolerance
    of a replica that applied them one by one."""
    _, reference, updates = _setup(False)
    updates = sorted(updates, key=lambda u: (u.head.group_key, u.seq))
    bounds = [0, *sorted(cuts), len(updates)]
    rounds_of = [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
    group = _group(updates, rounds_of)
    _one_by_one(reference, updates)
    assert _settled_apart(group, reference) <= SETTLE_TOLERANCE


def test_a_member_on_another_applied_set_makes_the_others_fall_back() -> None:
    members, _, updates = _setup(False)
    members[2].submit_group(_update(Spec(4, 3, "honest", 0, 0), 9, 16), _everyone)
    rounds = _rounds(members, updates)
    _fetch(rounds)
    _exchange_parts(rounds)
    before = [p.replica.params.clone() for p in members]
    _exchange_sums(rounds)
    assert all(m.apply() is None for m in rounds)
    assert rounds[0].failed == f"gram_wrong_state from {MEMBERS[2]}"
    assert rounds[2].failed is not None and rounds[2].failed.startswith("gram_wrong_state")
    assert all(torch.equal(p.replica.params, b) for p, b in zip(members, before, strict=True))


def test_slices_that_fail_their_checks_make_the_others_fall_back() -> None:
    members, _, updates = _setup(False)
    rounds = _rounds(members, updates)
    _fetch(rounds)
    _exchange_parts(rounds)
    for member in rounds:
        member.decide()
    honest = rounds[1].sums()
    assert honest is not None
    assert not rounds[0].sums_from(MEMBERS[1], [x * 2 for x in honest])
    assert rounds[0].failed == f"sums_norm from {MEMBERS[1]}"
    assert rounds[0].apply() is None
    assert not rounds[2].part_from("stranger", [[0.0]])  # not a member: ignored, no failure
    assert rounds[2].failed is None


def test_sums_checked_after_this_replica_moved_fail_it_as_moved_not_the_sender() -> None:
    """Session 24's bench: a whole fetch applied here between the plan and a member's sums
    made its honest sums fail `sums_direction` (checked against the moved state), counted
    against it. Now the round fails as "replica_moved": nobody's fault."""
    members, _, updates = _setup(False)
    rounds = _rounds(members, updates)
    _fetch(rounds)
    _exchange_parts(rounds)
    for member in rounds:
        member.decide()
    honest = rounds[1].sums()
    assert honest is not None
    members[0].submit_group(_update(Spec(4, 3, "honest", 0, 0), 9, 16), _everyone)
    assert not rounds[0].sums_from(MEMBERS[1], honest)
    assert rounds[0].failed == "replica_moved"
    assert rounds[0].apply() is None


def test_a_slice_not_finite_fails_the_round() -> None:
    members, _, updates = _setup(False)
    member = _rounds(members, updates)[0]
    start, end = member.slice
    assert not member.fetched(0, torch.full((end - start,), float("nan")))
    assert member.failed == "slice_not_finite" and member.part() is None


def test_a_round_whose_norm_cap_is_undecided_falls_back_at_every_member() -> None:
    """A whole outer step, then an update near the cap (merge.shard_round_cap): every member
    sets `failed` alike and applies nothing (the wiring then fetches the round whole)."""
    members = [_pipeline("delayed_nesterov") for _ in range(3)]
    updates = _whole_step_then_near_cap(members[0], 1.12)
    rounds = _rounds(members, updates)
    _fetch(rounds)
    _exchange_parts(rounds)
    before = [p.replica.params.clone() for p in members]
    _exchange_sums(rounds)
    assert [m.failed for m in rounds] == ["cap_undecided"] * 3
    assert all(m.apply() is None for m in rounds)
    assert all(torch.equal(p.replica.params, b) for p, b in zip(members, before, strict=True))
