"""Group reductions: members dropping anywhere leave a complete update or none, never half."""

from __future__ import annotations

import random
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.group_update import (
    Abandoned,
    ContributionHeader,
    GroupReduction,
    GroupUpdate,
    Phase,
    ReductionConfig,
    RoundFields,
)
from merge.identity import Identity

IDS = sorted((Identity.generate() for _ in range(10)), key=lambda i: i.peer_id)
BY_ID = {i.peer_id: i for i in IDS}
KEY = "groups.0b01"
FIELDS = RoundFields(
    run_id="r", group_key=KEY, epoch=2, round=7, learners=4, base_applied=10, published_applied=13
)


def _pg(seed: int, dim: int = 12, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(dim, generator=torch.Generator().manual_seed(seed)) * scale


def _contribute(red: GroupReduction, ident: Identity, pg: torch.Tensor) -> bool:
    return red.contribute(ContributionHeader.of(pg, ident, FIELDS, tokens=100), pg)


def _reduction(members: list[Identity], **config: float) -> GroupReduction:
    return GroupReduction(
        group_key=KEY,
        epoch=2,
        round=7,
        members=[m.peer_id for m in members],
        config=ReductionConfig(**config),  # type: ignore[arg-type]
    )


def _cosign_all(red: GroupReduction) -> Phase:
    for member in red.included:
        red.cosign(member, BY_ID[member].sign(red.statement(member)))
    return red.phase


def _expected_mean(
    pgs: dict[str, torch.Tensor], included: tuple[str, ...], ratio: float
) -> torch.Tensor:
    """The mean of the included contributions, each clipped to ratio x the median norm."""
    norms = {m: float(torch.linalg.vector_norm(pgs[m])) for m in included}
    bound = ratio * statistics.median(norms.values())
    total = torch.zeros_like(pgs[included[0]])
    for m in included:
        scale = bound / norms[m] if len(included) >= 3 and norms[m] > bound else 1.0
        total += pgs[m] * scale
    return total / len(included)


drops = st.lists(
    st.sampled_from(["none", "before_deadline", "while_reducing"]), min_size=1, max_size=8
)


@settings(max_examples=80, deadline=None)
@given(drops, st.randoms(use_true_random=False), st.integers(0, 2))
def test_members_dropping_at_random_points_leave_a_complete_update_or_none(
    fates: list[str], rng: random.Random, retries: int
) -> None:
    members = IDS[: len(fates)]
    red = _reduction(members, max_retries=retries)
    pgs = {m.peer_id: _pg(i, scale=1 + 9 * (i == 0)) for i, m in enumerate(members)}
    fate = {m.peer_id: f for m, f in zip(members, fates, strict=True)}
    for m in members:
        if fate[m.peer_id] != "before_deadline":
            assert _contribute(red, m, pgs[m.peer_id])
    red.close()
    deaths = [m for m, f in fate.items() if f == "while_reducing"]
    rng.shuffle(deaths)
    dead: set[str] = set()
    while red.phase is Phase.REDUCING:
        alive = [m for m in red.included if m not in dead]
        if deaths and (rng.random() < 0.5 or not alive):
            victim = deaths.pop()
            dead.add(victim)
            red.lose(victim)
            continue
        member = rng.choice(alive)
        red.cosign(member, BY_ID[member].sign(red.statement(member)))
    outcome = red.outcome
    contributed = {m for m, f in fate.items() if f != "before_deadline"}
    if isinstance(outcome, GroupUpdate):
        authors = tuple(h.author for h in outcome.contributions)
        assert set(authors) <= contributed and not set(authors) & dead
        assert len(authors) >= red.quorum
        assert outcome.problem(lambda p: p in fate) is None
        assert torch.allclose(outcome.aggregate, _expected_mean(pgs, authors, 4.0), atol=1e-6)
    else:
        assert isinstance(outcome, Abandoned) and red.phase is Phase.ABANDONED
    final = red.outcome
    red.lose(IDS[0].peer_id)  # nothing after the outcome changes it
    assert red.outcome is final


def test_a_straggler_is_left_out_not_waited_for() -> None:
    red = _reduction(IDS[:4])
    for i, m in enumerate(IDS[:3]):
        _contribute(red, m, _pg(i))
    assert red.close() is Phase.REDUCING
    assert not _contribute(red, IDS[3], _pg(3)) and red.rejected == {"after_deadline": 1}
    assert _cosign_all(red) is Phase.COMPLETED
    assert isinstance(red.outcome, GroupUpdate) and len(red.outcome.contributions) == 3


def test_below_quorum_the_round_is_abandoned() -> None:
    red = _reduction(IDS[:5], quorum_share=0.6)
    for i, m in enumerate(IDS[:2]):
        _contribute(red, m, _pg(i))
    assert red.close() is Phase.ABANDONED
    assert red.outcome == Abandoned("below_quorum")


def test_one_dishonest_member_moves_the_group_update_no_more_than_the_bound() -> None:
    honest = {m.peer_id: _pg(i) for i, m in enumerate(IDS[:7])}
    red = _reduction(IDS[:8])
    for m in IDS[:7]:
        _contribute(red, m, honest[m.peer_id])
    _contribute(red, IDS[7], -1000 * _pg(99))
    red.close()
    _cosign_all(red)
    assert isinstance(red.outcome, GroupUpdate)
    honest_mean = sum(honest.values()) / 8  # type: ignore[operator]
    median = sorted(float(torch.linalg.vector_norm(v)) for v in honest.values())[3]
    moved = float(torch.linalg.vector_norm(red.outcome.aggregate - honest_mean))
    assert moved <= 4.0 * median / 8 * 1.5  # clipped to 4x the median, over 8 members


def test_contributions_from_strangers_forgeries_and_other_rounds_are_counted_and_refused() -> None:
    red = _reduction(IDS[:3])
    stranger = IDS[5]
    assert not _contribute(red, stranger, _pg(0))
    forged = ContributionHeader.of(_pg(1), IDS[0], FIELDS, tokens=100)
    assert not red.contribute(forged, _pg(2))  # the digest is of another tensor
    other_round = RoundFields(**{**FIELDS.__dict__, "round": 8})
    assert not red.contribute(ContributionHeader.of(_pg(3), IDS[1], other_round, tokens=1), _pg(3))
    assert _contribute(red, IDS[2], _pg(4)) and not _contribute(red, IDS[2], _pg(4))
    assert red.rejected == {"not_a_member": 1, "bad_signature": 1, "wrong_round": 1, "duplicate": 1}


def _completed(n: int) -> GroupUpdate:
    red = _reduction(IDS[:n])
    for i, m in enumerate(IDS[:n]):
        _contribute(red, m, _pg(i))
    red.close()
    _cosign_all(red)
    assert isinstance(red.outcome, GroupUpdate)
    return red.outcome


def test_a_tampered_group_update_is_refused_by_every_replica() -> None:
    update = _completed(4)
    members = {m.peer_id for m in IDS[:4]}
    assert update.problem(members.__contains__) is None
    assert update.tokens == 400 and update.head.learners == 4
    tampered = GroupUpdate(
        update.contributions, update.shard_digests, update.cosignatures, update.aggregate + 1
    )
    assert tampered.problem(members.__contains__) == "shard_mismatch"
    swapped = GroupUpdate(
        update.contributions,
        update.shard_digests,
        update.cosignatures[::-1],
        update.aggregate,
    )
    assert swapped.problem(members.__contains__) == "bad_cosignature"
    dropped = GroupUpdate(
        update.contributions[1:],
        update.shard_digests[1:],
        update.cosignatures[1:],
        update.aggregate,
    )
    assert dropped.problem(members.__contains__) is not None
    assert update.problem(lambda p: p != IDS[0].peer_id) == "not_a_member"
    poisoned = update.aggregate.clone()
    poisoned[0] = float("nan")
    nan = GroupUpdate(update.contributions, update.shard_digests, update.cosignatures, poisoned)
    assert nan.problem(members.__contains__) == "not_finite"


@pytest.mark.parametrize(
    "kwargs", [{"quorum_share": 0}, {"max_retries": -1}, {"max_norm_to_median": -1}]
)
def test_bad_reduction_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        ReductionConfig(**kwargs)  # type: ignore[arg-type]
