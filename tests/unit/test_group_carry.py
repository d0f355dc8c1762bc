"""A member's carried contributions (merge/group_carry.py): a round it gave up on that completed
at the others is taken back out of what it carries, whichever comes first, so the sum of what
its included contributions hold is the sum of what it trained."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.group_carry import CarriedContributions
from merge.group_update import ContributionHeader, GroupReduction, GroupUpdate, RoundFields
from merge.identity import Identity

ME, OTHER = Identity.generate(), Identity.generate()
KEY = "groups.0b"
DIM = 6


def _fields(round_: int) -> RoundFields:
    return RoundFields(
        run_id="r", group_key=KEY, epoch=0, round=round_, learners=1,
        base_applied=round_, published_applied=round_,
    )  # fmt: skip


def _header(total: torch.Tensor, round_: int, who: Identity = ME) -> ContributionHeader:
    return ContributionHeader.of(total, who, _fields(round_), tokens=10)


def _update(round_: int, mine: torch.Tensor | None) -> GroupUpdate:
    """The round's complete update: with this member's `mine` in it, or without it."""
    red = GroupReduction(group_key=KEY, epoch=0, round=round_, members=[ME.peer_id, OTHER.peer_id])
    theirs = torch.ones(DIM)
    assert red.contribute(_header(theirs, round_, OTHER), theirs)
    if mine is not None:
        assert red.contribute(_header(mine, round_), mine)
    red.close()
    for member in red.included:
        by = ME if member == ME.peer_id else OTHER
        red.cosign(member, by.sign(red.statement(member)))
    assert isinstance(red.outcome, GroupUpdate)
    return red.outcome


def test_an_update_applied_after_the_round_was_carried_is_owed_once() -> None:
    carried = CarriedContributions(ME.peer_id)
    total = torch.arange(DIM, dtype=torch.float32)
    carried.carry(_header(total, 3), total)
    update = _update(3, total)
    assert carried.applied(update)
    assert not carried.applied(update)  # once
    owed = carried.take_owed()
    assert owed is not None and torch.equal(owed, total)
    assert carried.take_owed() is None


def test_an_update_applied_before_the_member_settled_is_owed_when_it_carries() -> None:
    carried = CarriedContributions(ME.peer_id)
    total = torch.arange(DIM, dtype=torch.float32)
    assert not carried.applied(_update(4, total))  # pushed while it waited for co-signatures
    carried.carry(_header(total, 4), total)
    owed = carried.take_owed()
    assert owed is not None and torch.equal(owed, total)


def test_updates_without_this_member_or_with_another_contribution_owe_nothing() -> None:
    carried = CarriedContributions(ME.peer_id)
    total = torch.arange(DIM, dtype=torch.float32)
    carried.carry(_header(total, 5), total)
    assert not carried.applied(_update(5, None))  # left out: its residual is right
    assert not carried.applied(_update(5, total + 1))  # not what it carried (digest differs)
    assert not carried.applied(_update(6, total))  # another round
    assert carried.take_owed() is None and carried.num_owed == 0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["included", "left_out", "abandoned", "gave_up"]),
            st.integers(-1, 4),  # when a gave-up round's update arrives: rounds later (-1: never)
            st.booleans(),  # before the member settles that round, or after
            st.lists(st.integers(-3, 3), min_size=DIM, max_size=DIM),
        ),
        min_size=1,
        max_size=10,
    )
)
def test_what_included_contributions_hold_plus_the_residual_is_what_was_trained(
    rounds: list[tuple[str, int, bool, list[int]]],
) -> None:
    """Rounds with every outcome, and the updates of rounds the member gave up on (that the
    others completed with it) applied at random later points, before or after it settled:
    the contributions inside applied updates plus what it still carries equal the sum of its
    pseudo-gradients (none counted twice, none dropped)."""
    carried = CarriedContributions(ME.peer_id)
    residual, trained, in_applied = torch.zeros(DIM), torch.zeros(DIM), torch.zeros(DIM)
    pending: list[tuple[int, bool, GroupUpdate, torch.Tensor]] = []

    def apply(update: GroupUpdate, mine: torch.Tensor) -> None:
        nonlocal in_applied
        in_applied = in_applied + mine
        carried.applied(update)

    def deliver(now: int, before: bool) -> None:
        for entry in [p for p in pending if p[0] == now and p[1] == before]:
            pending.remove(entry)
            apply(entry[2], entry[3])

    for r, (outcome, delay, before, values) in enumerate(rounds):
        pg = torch.tensor(values, dtype=torch.float32)
        trained += pg
        owed = carried.take_owed()
        total = pg + residual - (0 if owed is None else owed)
        if outcome == "gave_up" and delay >= 0:
            pending.append((r + delay, before, _update(r, total), total))
        deliver(r, True)
        if outcome == "included":
            apply(_update(r, total), total)
            residual = torch.zeros(DIM)
        else:
            carried.carry(_header(total, r), total)
            residual = total
        deliver(r, False)
    for _at, _before, update, mine in sorted(pending, key=lambda p: (p[0], not p[1])):
        apply(update, mine)
    owed = carried.take_owed()
    residual = residual - (0 if owed is None else owed)
    assert torch.equal(in_applied + residual, trained)


def _saved(state: dict[str, object]) -> dict[str, object]:
    """Through a checkpoint file's format (torch.save, torch.load(weights_only=True))."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@settings(max_examples=30, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["carry", "applied", "take"]), st.integers(0, 3)), max_size=10
    ),
    restart_at=st.integers(0, 10),
)
def test_a_restart_remembers_carried_contributions(
    events: list[tuple[str, int]], restart_at: int
) -> None:
    """Carry, apply and take in any order, with a checkpoint and restart anywhere: each step
    decides as for a member that never restarted, and the same is owed (session 10 forgot
    the carries: an update arriving after a restart was counted twice)."""
    steady = CarriedContributions(ME.peer_id)
    restarted = CarriedContributions(ME.peer_id)
    for i, (what, round_) in enumerate(events + [("take", 0)]):
        if i == restart_at:
            fresh = CarriedContributions(ME.peer_id)
            fresh.load_state_dict(_saved(restarted.state_dict()), DIM)
            restarted = fresh
        total = torch.full((DIM,), float(round_ + 1))
        if what == "carry":
            steady.carry(_header(total, round_), total)
            restarted.carry(_header(total, round_), total)
        elif what == "applied":
            update = _update(round_, total)
            assert steady.applied(update) == restarted.applied(update)
        else:
            a, b = steady.take_owed(), restarted.take_owed()
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    assert steady.num_owed == restarted.num_owed


@pytest.mark.parametrize(
    "state",
    [
        {"carried": [["k", 0, 1, "d"]]},
        {"carried": [["k", 0, 1, "d", torch.zeros(DIM + 1)]]},
        {"carried": [["k", 0, 1, "d", torch.full((DIM,), float("nan"))]]},
        {"included": [[1, 0, 1, "d"]]},
        {"included": "x"},
        {"owed": torch.zeros(DIM, dtype=torch.float64)},
        {"num_owed": -1},
    ],
)
def test_a_damaged_or_foreign_carry_checkpoint_is_refused_and_changes_nothing(
    state: dict[str, object],
) -> None:
    carried = CarriedContributions(ME.peer_id)
    total = torch.arange(DIM, dtype=torch.float32)
    carried.carry(_header(total, 3), total)
    with pytest.raises(ValueError, match="carried contributions"):
        carried.load_state_dict(state, DIM)
    assert carried.applied(_update(3, total))  # still carried


def test_a_group_members_error_feedback_checkpoints_its_carries_with_its_residual() -> None:
    from merge.codecs import get_codec
    from merge.group_carry import GroupFeedback

    carried = CarriedContributions(ME.peer_id)
    feedback = GroupFeedback(get_codec("int8"), DIM, carried)
    total = torch.arange(DIM, dtype=torch.float32)
    feedback.residual = total.clone()
    carried.carry(_header(total, 3), total)
    again = GroupFeedback(get_codec("int8"), DIM, CarriedContributions(ME.peer_id))
    again.load_state_dict(_saved(feedback.state_dict()))
    assert torch.equal(again.residual, total)
    assert again.carried.applied(_update(3, total))
    plain = GroupFeedback(get_codec("int8"), DIM, CarriedContributions(ME.peer_id))
    plain.load_state_dict({"codec": "int8", "residual": total.clone()})  # session 10's
    assert torch.equal(plain.residual, total) and not plain.carried.applied(_update(3, total))
