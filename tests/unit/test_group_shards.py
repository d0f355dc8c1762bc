"""Reduce-scatter inside a group: the split, who reduces what, and rounds with members
dropping at random points that end with one complete update on every live member, or none."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.group_chunks import aligned_bounds, shard_digests, split
from merge.group_plan import ShardPlan, shard_bounds
from merge.group_shards import ShardedReduction, sharded_contribution
from merge.group_update import (
    Abandoned,
    GroupUpdate,
    Phase,
    ReductionConfig,
    RoundFields,
    clipped_mean,
)
from merge.identity import Identity

IDS = sorted((Identity.generate() for _ in range(9)), key=lambda i: i.peer_id)
BY_ID = {i.peer_id: i for i in IDS}
KEY = "groups.0b1"
FIELDS = RoundFields(
    run_id="r", group_key=KEY, epoch=1, round=3, learners=2, base_applied=5, published_applied=6
)
DIM = 23


def _pg(seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(DIM, generator=torch.Generator().manual_seed(seed)) * scale


def _view(members: list[str], **config: float) -> ShardedReduction:
    return ShardedReduction(
        group_key=KEY,
        epoch=1,
        round=3,
        members=members,
        numel=DIM,
        config=ReductionConfig(**config),  # type: ignore[arg-type]
    )


# ---- the plan -------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(numel=st.integers(0, 300), shards=st.integers(1, 40))
def test_bounds_cut_as_tensor_split(numel: int, shards: int) -> None:
    cut = [len(t) for t in torch.tensor_split(torch.zeros(numel), shards)]
    assert [end - start for start, end in shard_bounds(numel, shards)] == cut


@settings(max_examples=100, deadline=None)
@given(numel=st.integers(0, 5000), shards=st.integers(1, 40))
def test_a_plan_splits_on_the_chunk_grid(numel: int, shards: int) -> None:
    """Every member's shard is a run of whole chunks (merge.group_chunks, session 27)."""
    plan = ShardPlan.of(f"m{k:02d}" for k in range(shards))
    assert plan.bounds(numel) == aligned_bounds(numel, shards)


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 9),
    data=st.data(),
)
def test_reducers_included_own_shards_and_a_loss_moves_only_its_shards(
    size: int, data: st.DataObject
) -> None:
    members = [i.peer_id for i in IDS[:size]]
    plan = ShardPlan.of(members)
    included = data.draw(st.sets(st.sampled_from(members), min_size=1))
    reducers = plan.reducers(included)
    assert len(reducers) == size and set(reducers) <= included
    assert all(reducers[j] == m for j, m in enumerate(plan.members) if m in included)
    assert reducers == ShardPlan.of(reversed(members)).reducers(sorted(included))  # pure
    if len(included) > 1:
        lost = data.draw(st.sampled_from(sorted(included)))
        after = plan.reducers(included - {lost})
        moved = {j for j in range(size) if after[j] != reducers[j]}
        assert moved == {j for j in range(size) if reducers[j] == lost}


def test_plan_refuses_what_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="sorted member list"):
        ShardPlan(("b", "a"))
    with pytest.raises(ValueError, match="non-empty subset"):
        ShardPlan.of(["a", "b"]).reducers(["c"])
    assert ShardPlan.of(["a", "b", "c"]).sends("b") == [(0, "a"), (2, "c")]


# ---- one view of the whole group (the simulator's) -------------------------------------------


def _whole(members: list[Identity], pgs: dict[str, torch.Tensor], **config: float):
    view = _view([m.peer_id for m in members], **config)
    for ident in members:
        header, digests = sharded_contribution(pgs[ident.peer_id], ident, FIELDS, 10, len(members))
        assert view.contribute(header, digests)
        for j, piece in enumerate(split(pgs[ident.peer_id], len(members))):
            assert view.take_piece(ident.peer_id, j, piece)
    return view


def _reduce_all(view: ShardedReduction) -> None:
    for j, reducer in enumerate(view.reducers):
        shard = view.reduce(j)
        view.take_reduced(j, shard, BY_ID[reducer].sign(view.statement(j, shard)))


def test_whole_group_equals_the_clipped_mean_and_verifies() -> None:
    members = IDS[:5]
    pgs = {m.peer_id: _pg(k, 50.0 if k == 0 else 1.0) for k, m in enumerate(members)}
    view = _whole(members, pgs)
    assert view.close() is Phase.REDUCING
    _reduce_all(view)
    update = view.outcome
    assert isinstance(update, GroupUpdate)
    ordered = sorted(pgs)
    expected = clipped_mean(
        [pgs[m] for m in ordered],
        [float(torch.linalg.vector_norm(pgs[m])) for m in ordered],
        ReductionConfig(),
    )
    assert torch.allclose(update.aggregate, expected, atol=1e-6)
    assert update.problem(lambda p: True) is None
    assert update.problem(lambda p: p != IDS[3].peer_id) == "not_a_member"


def test_a_straggler_shard_goes_to_an_included_member() -> None:
    members = IDS[:4]
    pgs = {m.peer_id: _pg(k) for k, m in enumerate(members)}
    view = _whole(members[:3], pgs)  # IDS[3] never contributes
    view = _view([m.peer_id for m in members])
    for ident in members[:3]:
        header, digests = sharded_contribution(pgs[ident.peer_id], ident, FIELDS, 10, 4)
        view.contribute(header, digests)
        for j, piece in enumerate(split(pgs[ident.peer_id], 4)):
            view.take_piece(ident.peer_id, j, piece)
    view.close()
    assert view.reducers[3] in {m.peer_id for m in members[:3]}
    _reduce_all(view)
    assert isinstance(view.outcome, GroupUpdate)
    assert view.outcome.problem(lambda p: True) is None
    assert len(view.outcome.contributions) == 3


def test_refusals_are_counted_never_raised() -> None:
    members = IDS[:3]
    view = _view([m.peer_id for m in members])
    pg = _pg(1)
    header, digests = sharded_contribution(pg, IDS[0], FIELDS, 10, 3)
    assert not view.take_piece(IDS[0].peer_id, 0, pg[:8])  # no header yet
    assert not view.contribute(header, digests[:2])  # wrong count
    assert not view.contribute(replace(header, tokens=11), digests)  # not what it signed
    outsider, outsider_digests = sharded_contribution(pg, IDS[5], FIELDS, 10, 3)
    assert not view.contribute(outsider, outsider_digests)
    assert view.contribute(header, digests)
    assert not view.contribute(header, digests)
    assert not view.take_piece(IDS[0].peer_id, 0, pg[:7])  # wrong size
    assert not view.take_piece(IDS[0].peer_id, 1, pg[:8])  # not the signed piece
    assert not view.take_piece(IDS[0].peer_id, 5, pg[:8])
    assert not view.take_piece(IDS[0].peer_id, 0, torch.full((8,), float("nan")))
    assert view.rejected == {
        "piece_without_header": 1,
        "wrong_shards": 1,
        "bad_signature": 1,
        "not_a_member": 1,
        "duplicate": 1,
        "wrong_size": 1,
        "bad_piece": 1,
        "bad_shard": 1,
        "not_finite": 1,
    }


def test_a_member_cannot_forge_an_update_from_honest_headers() -> None:
    """A dishonest member holding the honest headers signs every shard itself: refused (each
    included member reduces its own shard, and only it can co-sign it)."""
    members = IDS[:3]
    pgs = {m.peer_id: _pg(k) for k, m in enumerate(members)}
    view = _whole(members, pgs)
    view.close()
    _reduce_all(view)
    honest = view.outcome
    assert isinstance(honest, GroupUpdate)
    evil = torch.full_like(honest.aggregate, 3.0)
    digests = shard_digests(evil, 3)
    forged = GroupUpdate(
        honest.contributions,
        digests,
        tuple(IDS[0].sign(honest.statement(j, d)) for j, d in enumerate(digests)),
        evil,
        honest.members,
    )
    assert forged.problem(lambda p: True) == "bad_cosignature"
    tampered = GroupUpdate(
        honest.contributions, honest.shard_digests, honest.cosignatures, evil, honest.members
    )
    assert tampered.problem(lambda p: True) == "shard_mismatch"


# ---- members' own views over a network dropping members ---------------------------------------


def _round(size: int, stragglers: set[int], dying: dict[int, int], seed: int) -> dict[str, object]:
    """One round among `size` members, each with its own view; stragglers never send;
    dying[k] = how many of its reduced shards' deliveries member k makes before it dies
    after the deadline. Returns each live member's outcome."""
    rng = random.Random(seed)
    members = IDS[:size]
    names = [m.peer_id for m in members]
    views = {m: _view(names) for m in names}
    pgs = {m: _pg(seed * 31 + k) for k, m in enumerate(names)}
    signed = {}
    for k, ident in enumerate(members):
        if k in stragglers:
            continue
        signed[ident.peer_id] = sharded_contribution(pgs[ident.peer_id], ident, FIELDS, 10, size)
    plan = ShardPlan.of(names)
    for author, (header, digests) in signed.items():  # header and shard j to member j
        pieces = split(pgs[author], size)
        for j, target in enumerate(plan.members):
            views[target].contribute(header, digests)
            views[target].take_piece(author, j, pieces[j])
        for j, piece in enumerate(pieces):  # its own view holds its whole part
            views[author].take_piece(author, j, piece)
    dead: set[str] = set()
    budget = {names[k]: n for k, n in dying.items() if k < size and k not in stragglers}
    for view in views.values():
        view.close()
    for _ in range(4):  # attempts: re-send pieces, reduce, all-gather
        for author in signed:
            if author in dead or views[author].phase is not Phase.REDUCING:
                continue
            pieces = split(pgs[author], size)
            for j, reducer in plan.sends(author, views[author].included):
                if reducer not in dead and views[reducer].piece_of(author, j) is None:
                    views[reducer].take_piece(author, j, pieces[j])
        for member in rng.sample(names, size):
            view = views[member]
            if member in dead or view.phase is not Phase.REDUCING:
                continue
            for j in view.shards_of(member):
                if not view.ready(j):
                    continue
                shard = view.reduce(j)
                signature = BY_ID[member].sign(view.statement(j, shard))
                for target in [member, *rng.sample(view.included, len(view.included))]:
                    if budget.get(member, 1) <= 0:
                        dead.add(member)
                        break
                    if target not in dead:
                        views[target].take_reduced(j, shard, signature, view.included)
                    if member in budget:
                        budget[member] -= 1
        for member, view in views.items():  # the others notice the dead
            for gone in dead:
                if member not in dead:
                    view.lose(gone)
    live = {m: v for m, v in views.items() if m not in dead}
    complete = [v.outcome for v in live.values() if isinstance(v.outcome, GroupUpdate)]
    for view in live.values():  # a group-done notice: the others adopt, or give up
        if view.outcome is None and complete:
            view.adopt(complete[0])
        view.expire()
    return {"outcomes": {m: v.outcome for m, v in live.items()}, "pgs": pgs}


@settings(max_examples=120, deadline=None)
@given(
    size=st.integers(2, 7),
    stragglers=st.sets(st.integers(0, 6), max_size=2),
    dying=st.dictionaries(st.integers(0, 6), st.integers(0, 8), max_size=2),
    seed=st.integers(0, 10_000),
)
def test_members_dropping_leave_one_complete_update_or_none(
    size: int, stragglers: set[int], dying: dict[int, int], seed: int
) -> None:
    result = _round(size, stragglers, dying, seed)
    outcomes = result["outcomes"]
    pgs = result["pgs"]
    assert isinstance(outcomes, dict) and isinstance(pgs, dict)
    complete = [o for o in outcomes.values() if isinstance(o, GroupUpdate)]
    assert all(o is not None for o in outcomes.values())
    if not complete:
        return
    # never half: one update wherever it completed (a member that gave up keeps its part,
    # taken back out when the update reaches it: merge.group_carry)
    first = complete[0]
    for o in complete:
        assert o.update_id == first.update_id and o.contributions == first.contributions
        assert torch.equal(o.aggregate, first.aggregate)
    included = [h.author for h in first.contributions]
    assert first.problem(lambda p: True) is None
    expected = clipped_mean(
        [pgs[m] for m in included],
        [float(torch.linalg.vector_norm(pgs[m])) for m in included],
        ReductionConfig(),
    )
    assert torch.allclose(first.aggregate, expected, atol=1e-6)


def test_no_loss_completes_and_a_loss_retries_once() -> None:
    result = _round(5, set(), {}, 1)
    outcomes = result["outcomes"]
    assert isinstance(outcomes, dict)
    assert all(isinstance(o, GroupUpdate) for o in outcomes.values())
    result = _round(5, set(), {2: 0}, 2)  # member 2 dies before any shard of its is out
    outcomes = result["outcomes"]
    assert isinstance(outcomes, dict) and len(outcomes) == 4
    updates = [o for o in outcomes.values() if isinstance(o, GroupUpdate)]
    assert len(updates) == 4 and len(updates[0].contributions) == 4
    result = _round(5, set(), {1: 0, 3: 0}, 3)  # two lost: abandoned (one retry)
    outcomes = result["outcomes"]
    assert isinstance(outcomes, dict)
    assert all(isinstance(o, Abandoned) for o in outcomes.values())
