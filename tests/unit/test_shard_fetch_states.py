"""The state check before a fetch round fetches (merge.shard_fetch `state_blocks`,
`states_problem`; docs/scale.md, Session 18): each member proposes its replica's state block
over every member's slice; members whose replicas differ fall back at `compose`, alike on
every member and before any slice is fetched, and nobody is counted as refusing. Replicas of
one applied set that applied it in other orders differ when the orders put updates on other
sides of a Delayed Nesterov fold (the momentum holds other batches), by rounding only when
they do not."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.group_exchange_fetch import FetchExchange
from dht.grouping_wire import GroupMessageError
from dht.shard_fetch_wire import FetchMessage, proposal_body, proposal_of, states_body, states_of
from merge.identity import Identity
from merge.pipeline import UpdatePipeline
from merge.shard_fetch import Proposal, compose, left_out, state_blocks, states_problem
from merge.shard_round import STATE_SLACK, state_tensors
from merge.shard_states import states_digest
from tests.unit.shard_round_paths import Spec, _everyone, _pipeline, _update
from tests.unit.test_shard_member import MEMBERS, _fetch, _rounds, _setup

BASE = (7, "ab" * 32)
UID = ("groups.0b1", 3)


def _proposals(pipelines: list[UpdatePipeline], members: list[str]) -> dict[str, Proposal]:
    return {
        m: Proposal(BASE, {UID: ("h",)}, state_blocks(state_tensors(p.replica), len(members)))
        for m, p in zip(members, pipelines, strict=True)
    }


def test_members_at_one_state_compose_and_propose_what_their_parts_claim() -> None:
    pipelines, _, updates = _setup(True)
    composition = compose(_proposals(pipelines, MEMBERS), MEMBERS)
    assert not isinstance(composition, str) and composition.ids == (UID,)
    rounds = _rounds(pipelines, updates)
    _fetch(rounds)
    blocks = state_blocks(state_tensors(pipelines[0].replica), len(MEMBERS))
    for index, member in enumerate(rounds):  # the proposal's block: the part's state block
        part = member.part()
        assert part is not None
        size = len(state_tensors(pipelines[0].replica))
        claimed = tuple(part[i][j] for i in range(size) for j in range(i, size))
        # float64 sums, sent (and kept) in float32 values since session 29 (merge.shard_part)
        assert claimed == pytest.approx(blocks[index], rel=2**-23)


def _replica_after(order: list[int]) -> UpdatePipeline:
    """A Delayed Nesterov replica (2 learners a round: a fold every two updates) that
    applied updates 0-5 in `order`, then 6-9 in order."""
    pipeline = _pipeline("delayed_nesterov")
    updates = [_update(Spec(g % 4, g // 4, "honest", 0, 0), g, 2) for g in range(10)]
    for g in [*order, 6, 7, 8, 9]:
        assert pipeline.submit_group(updates[g], _everyone).accepted
    return pipeline


@pytest.mark.parametrize(
    ("order", "outcome"),
    [
        ([0, 1, 2, 3, 4, 5], None),
        ([1, 0, 2, 3, 5, 4], None),  # swapped inside one fold's batch: rounding only
        ([0, 2, 1, 3, 4, 5], "state_differs"),  # 1 and 2 on other sides of a fold
    ],
    ids=["same-order", "swapped-in-a-batch", "swapped-across-a-fold"],
)
def test_replicas_of_one_set_in_other_orders_differ_only_across_a_fold(
    order: list[int], outcome: str | None
) -> None:
    """Session 17's 65 `gram_wrong_state` rounds: members of one applied set whose orders put
    an update in another fold's batch hold other momenta (and params moved along them) far
    beyond rounding, four folds later still; in one batch, the order is rounding."""
    reference, other = _replica_after([0, 1, 2, 3, 4, 5]), _replica_after(order)
    assert reference.replica.applied == other.replica.applied
    members = sorted(["a", "b"])
    proposals = _proposals([reference, other], members)
    result = compose(proposals, members)
    assert (result if isinstance(result, str) else None) == outcome


block_st = st.tuples(*(st.floats(0.5, 4.0) for _ in range(3))).map(
    lambda d: (d[0], 0.1 * d[0], 0.0, d[1], 0.2, d[2])
)


@settings(max_examples=60, deadline=None)
@given(
    blocks=st.lists(block_st, min_size=2, max_size=4),
    who=st.integers(0, 3),
    slot=st.integers(0, 5),
    shift=st.sampled_from([0.0, 0.3, 3.0, 300.0]),
    seed=st.integers(0, 1000),
)
def test_states_that_differ_fall_back_alike_on_every_member(
    blocks: list[tuple[float, ...]], who: int, slot: int, shift: float, seed: int
) -> None:
    """Every member proposes the same blocks but one, moved by `shift` x the slack at one
    entry: within the slack the round composes, beyond it every member falls back with
    "state_differs" whatever order the proposals came in."""
    members = [f"peer{i}" for i in range(len(blocks))]
    who %= len(members)
    proposals = {m: Proposal(BASE, {UID: ("h",)}, tuple(blocks)) for m in members}
    moved = list(blocks[who])
    diagonal = {0: (0, 0), 1: (0, 3), 2: (0, 5), 3: (3, 3), 4: (3, 5), 5: (5, 5)}[slot]
    scale = (blocks[who][diagonal[0]] * blocks[who][diagonal[1]]) ** 0.5
    moved[slot] += shift * STATE_SLACK * scale
    mine = list(blocks)
    mine[who] = tuple(moved)
    proposals[members[who]] = Proposal(BASE, {UID: ("h",)}, tuple(mine))
    shuffled = list(proposals.items())
    random.Random(seed).shuffle(shuffled)
    a, b = compose(proposals, members), compose(dict(shuffled), list(reversed(members)))
    assert a == b
    # the slack is relative to the larger of the norms compared: a shift of the diagonal
    # itself raises them, so 3x the slack is past it only off the diagonal or upward far.
    if shift >= 300.0 and len(members) == 2:
        assert a == "state_differs"  # no two members alike: both fall back
    elif shift >= 300.0:  # the others run the round; the moved one falls back alone
        assert not isinstance(a, str)
        assert a.members == tuple(m for m in members if m != members[who])
        assert left_out(a, proposals, members[who]) == "left_out_state"
    if shift == 0.0 or shift == 0.3:
        assert not isinstance(a, str) and a.members == tuple(members)


def test_a_member_on_another_base_is_left_out_and_the_others_run_the_round() -> None:
    block = ((1.0, 0.0, 1.0),) * 3
    proposals = {m: Proposal(BASE, {UID: ("h",)}, block) for m in ("a", "b", "c")}
    proposals["b"] = Proposal((8, BASE[1]), {UID: ("h",)}, block)
    composition = compose(proposals, ["c", "b", "a"])
    assert not isinstance(composition, str)
    assert composition.members == ("a", "c") and composition.ids == (UID,)
    assert left_out(composition, proposals, "b") == "left_out_base"
    assert left_out(composition, proposals, "a") is None
    two = {m: Proposal(p.base, p.candidates, block[:2]) for m, p in proposals.items() if m != "c"}
    assert compose(two, ["a", "b"]) == "base_differs"


def test_blocks_of_the_wrong_shape_or_count_are_out_of_bounds() -> None:
    good = ((1.0, 0.0, 1.0),)
    assert states_problem([good, good], 1) is None
    assert states_problem([good, ()], 1) == "proposal_out_of_bounds"
    assert states_problem([good, good + good], 1) == "proposal_out_of_bounds"
    assert states_problem([(), ()], 1) is None  # nothing proposed: the part check guards
    assert Proposal(BASE, {}, ((1.0, 2.0),)).problem() == "bad_states"
    assert Proposal(BASE, {}, ((1.0,), (1.0, 0.0, 1.0))).problem() == "bad_states"
    assert Proposal(BASE, {}, good).problem() is None


def test_a_proposals_states_travel_signed_and_bad_ones_are_refused() -> None:
    me = Identity.generate()
    proposal = Proposal(BASE, {UID: ("h",)}, ((1.5, -0.25, 2.0), (1e-30, 0.0, 3e20)))
    rid = ("groups.0b0", 0, 1)
    signed = FetchMessage("run", rid, "propose", me.peer_id, proposal_body(proposal), ())
    back = proposal_of(signed.signed(me))  # session 28: the blocks by their digest
    assert back == Proposal(BASE, {UID: ("h",)}, (), states_digest(proposal.states))
    body = states_body(proposal.states)
    states = FetchMessage("run", rid, "states", me.peer_id, body, ()).signed(me)
    assert states.verified() and states_of(states) == proposal.states
    bad_states: list[object] = [[[1, 2, 3]], [["x"]], [[]], [[1.0] * 11], "no", [[1.0]] * 1025]
    for bad_body in bad_states:
        bad = FetchMessage("run", rid, "states", me.peer_id, {"states": bad_body}, ())
        with pytest.raises(GroupMessageError):
            states_of(bad)


def test_a_state_check_failed_is_no_refusal_of_the_peer() -> None:
    rejected: list[str] = []
    exchange = SimpleNamespace(num_state_differs=0, _reject=lambda r, p, d: rejected.append(r))
    refused = FetchExchange._refused
    refused(exchange, "group_fetch_part_refused", "peer", "gram_wrong_state from peer")  # type: ignore[arg-type]
    refused(exchange, "group_fetch_sums_refused", "peer", "sums_direction from peer")  # type: ignore[arg-type]
    assert rejected == [] and exchange.num_state_differs == 2
    refused(exchange, "group_fetch_part_refused", "peer", "gram_beyond_schwarz from peer")  # type: ignore[arg-type]
    assert rejected == ["group_fetch_part_refused"]


def test_a_round_that_failed_on_this_side_or_another_members_part_refuses_no_sender() -> None:
    rejected: list[tuple[str, str]] = []
    exchange = SimpleNamespace(num_state_differs=0, _reject=lambda r, p, d: rejected.append((r, p)))
    refused = FetchExchange._refused
    refused(exchange, "group_fetch_part_refused", "peer", "replica_moved")  # type: ignore[arg-type]
    refused(exchange, "group_fetch_sums_refused", "peer", "gram_beyond_schwarz from other")  # type: ignore[arg-type]
    assert rejected == [] and exchange.num_state_differs == 0
    refused(exchange, "group_fetch_part_refused", "peer", None)  # type: ignore[arg-type]
    assert rejected == [("group_fetch_part_refused", "peer")]


def test_blocks_cover_every_slice_of_the_state() -> None:
    states = [torch.linspace(0.0, 1.0, 30), torch.ones(30)]
    blocks = state_blocks(states, 4)
    assert len(blocks) == 4 and all(len(b) == 3 for b in blocks)
    assert sum(b[0] for b in blocks) == pytest.approx(float(states[0] @ states[0]))
    assert sum(b[2] for b in blocks) == pytest.approx(30.0)
