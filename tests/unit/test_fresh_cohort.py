"""Fresh keys in an established open swarm (issue 20 must-haves 1 and 3): an author with no
track record does not raise the learner count that sizes honest updates, earns no record
with updates of no substance, and the fresh cohort moves at most its cap (`cohort_share`
fair shares).

Through the real pipeline (tests.unit.test_open_swarm's three honest authors). Each honest
author claims what a live node signs: itself plus its peers as the pipeline credits them
(node.swarm_link.live_learners), the stranger among the peers.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.contribution import ContributionLedger
from merge.learners import credited_learners
from merge.pipeline import UpdatePipeline
from merge.robust import Verdict, substance
from tests.unit.test_learner_floor import floor_after
from tests.unit.test_open_swarm import (
    HONEST,
    MALLORY,
    NUMEL,
    SYBILS,
    established,
    honest_delta,
    update,
)


def live_round(
    pipeline: UpdatePipeline, seq: int, strangers: set[str], shares: dict[str, float]
) -> list[int]:
    """One round of the honest authors, each claiming what a live node would; the learner
    counts their updates were sized by."""
    sized = []
    everyone = {h.peer_id for h in HONEST} | strangers
    for i, author in enumerate(HONEST):
        claim = 1 + pipeline.credited_learners(everyone - {author.peer_id})
        result = pipeline.submit(update(author, seq, honest_delta(i, seq), claim))
        assert result.accepted, result.reason
        shares[author.peer_id] = shares.get(author.peer_id, 0.0) + result.weight / result.learners
        sized.append(result.learners)
    return sized


@settings(max_examples=12, deadline=None)
@given(floods=st.lists(st.integers(0, 12), min_size=6, max_size=12), claim=st.integers(1, 8))
def test_a_zero_flooder_never_counts_as_a_learner_nor_earns_a_record(
    floods: list[int], claim: int
) -> None:
    """However many zero updates one author publishes between honest ones, and whatever it
    claims, honest updates stay sized by the honest swarm (3), the flooder earns no record,
    and what it moves is at most the cohort's cap (zeros move nothing, but count)."""
    pipeline = established()
    shares: dict[str, float] = {}
    seq = 0
    for round_, count in enumerate(floods, start=12):
        assert live_round(pipeline, round_, {MALLORY.peer_id}, shares) == [3, 3, 3]
        for _ in range(count):
            result = pipeline.submit(update(MALLORY, seq, torch.zeros(NUMEL), claim))
            seq += 1
            assert result.accepted
            shares["mallory"] = shares.get("mallory", 0.0) + result.weight / result.learners
    assert pipeline.ledger.record(MALLORY.peer_id) == 0.0
    assert not pipeline.ledger.is_established(MALLORY.peer_id)
    honest = sum(v for k, v in shares.items() if k != "mallory")
    # The cohort's cap: cohort_share fair shares of each round (1/(M - 1) of a round per
    # round of the others' progress, M = 3), plus its burst room (the cap itself).
    budget, m = pipeline.config.robust.budget, 3
    rounds = honest  # each honest round moves one round
    burst = budget.cohort_share * budget.budget_rounds / (m - 1)
    assert shares.get("mallory", 0.0) <= rounds * budget.cohort_share / (m - 1) + burst + 1e-9


@settings(max_examples=5, deadline=None)
@given(
    rounds=st.lists(
        st.tuples(st.integers(0, 300), st.sampled_from([None, 0, 1, 2])), min_size=2, max_size=4
    ),
    claim=st.integers(1, 1024),
)
def test_honest_updates_weigh_alike_with_and_without_a_flood_of_one_author(
    rounds: list[tuple[int, int | None]], claim: int
) -> None:
    """For any sequence of one author's zero updates interleaved with honest rounds (each
    now and then with an honest claim of 1: a node whose peer flapped as gone under the
    flood), every honest update is sized, judged and weighed as in the same swarm without the
    flooder: the honest contribution per round is what it is with no adversary. Before the
    floor's window held at most 1/8 of it per author, 256 zeros pushed the honest claims out
    and a claim of 1 was a whole outer step (bench.attack zero_flood)."""
    flooded, alone = established(), established()
    zeros = 0
    for round_, (count, flapper) in enumerate(rounds, start=12):
        for i, author in enumerate(HONEST):
            sent = update(author, round_, honest_delta(i, round_), 1 if i == flapper else 3)
            with_flood, without = flooded.submit(sent), alone.submit(sent)
            assert with_flood.accepted and without.accepted
            assert with_flood.learners == without.learners == 3
            assert with_flood.robust == without.robust
            assert math.isclose(with_flood.weight, without.weight, rel_tol=1e-9)
        for _ in range(count):
            assert flooded.submit(update(MALLORY, zeros, torch.zeros(NUMEL), claim)).accepted
            zeros += 1


def test_sybils_with_small_updates_claiming_huge_counts_leave_honest_sizes_alone() -> None:
    """40 fresh keys, each publishing a speck along the training direction every round while
    claiming 1,024 learners: no honest update is sized by more than the honest swarm."""
    pipeline = established()
    shares: dict[str, float] = {}
    sybils = {s.peer_id for s in SYBILS}
    for round_ in range(12, 24):
        assert live_round(pipeline, round_, sybils, shares) == [3, 3, 3]
        for sybil in SYBILS:
            small = 0.01 * honest_delta(9, round_)
            assert pipeline.submit(update(sybil, round_ - 12, small, 1024)).accepted
    assert not any(pipeline.ledger.has_substance(s) for s in sybils)


def test_an_honest_newcomer_counts_as_a_learner_after_its_first_update() -> None:
    """A fresh key whose updates are honest-sized counts (as the cohort's one learner) once
    it has one update's worth of record: the established authors beside it do not take
    whole outer steps, and it becomes established in time."""
    pipeline = established()
    newcomer = SYBILS[0]
    peers = {h.peer_id for h in HONEST}
    assert pipeline.credited_learners(peers | {newcomer.peer_id}) == 3
    for seq in range(16):
        assert pipeline.submit(update(newcomer, seq, honest_delta(7, seq), 4)).accepted
        if seq == 0:
            assert pipeline.credited_learners(peers | {newcomer.peer_id}) == 4
        live_round(pipeline, 12 + seq, {newcomer.peer_id}, {})
    assert pipeline.ledger.is_established(newcomer.peer_id)


@settings(max_examples=60, deadline=None)
@given(
    fresh=st.lists(st.tuples(st.integers(0, 200), st.integers(1, 1024)), max_size=80),
    honest=st.integers(1, 6),
    substantive=st.sets(st.integers(0, 200)),
)
def test_once_authors_are_established_fresh_keys_neither_vote_nor_count_without_substance(
    fresh: list[tuple[int, int]], honest: int, substantive: set[int]
) -> None:
    """With the cohort off (some author established), the floor of an established author's
    update is the established authors' alone, whatever fresh keys claimed; the live count is
    the established peers, plus one only if a fresh key has substance."""
    established_ = {f"h{i}" for i in range(honest)}
    history = [(a, honest) for _ in range(4) for a in sorted(established_)]
    without = floor_after(history)
    history += [(f"sybil{key}", claim) for key, claim in fresh]
    floor = floor_after(history)
    counted = established_.__contains__
    for author in established_:
        alone = without.floor(author, counted, cohort=False)
        assert floor.floor(author, counted, cohort=False) == alone
    keys = {key for key, _ in fresh}
    peers = established_ | {f"sybil{key}" for key in keys}
    cohort = {f"sybil{key}" for key in substantive}.__contains__
    assert credited_learners(peers, counted, cohort) == honest + bool(keys & substantive)


@given(
    norm=st.floats(0, 100),
    median=st.none() | st.floats(0, 100),
    scale=st.floats(0, 1),
    reason=st.sampled_from([None, "norm_outlier", "against_momentum", "off_center"]),
)
def test_substance_is_a_share_zero_for_nothing_and_whole_for_honest_sizes(
    norm: float, median: float | None, scale: float, reason: str | None
) -> None:
    value = substance(Verdict(reason, norm, median, None, scale))
    assert 0.0 <= value <= 1.0
    if norm == 0 or reason == "against_momentum":
        assert value == 0.0
    elif not median or norm * scale / median >= 0.5:
        assert value == 1.0


def test_a_record_of_no_substance_is_no_record() -> None:
    ledger = ContributionLedger()
    for _ in range(100):
        ledger.applied("z", 3, 1.0, evidence=0.0)
    assert ledger.record("z") == 0.0 and not ledger.has_substance("z")
