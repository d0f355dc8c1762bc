"""Open swarms (issue 20): one stranger publishing valid updates never stalls or bends the merge.

Three honest authors train along one direction; a stranger publishes what it likes, as fast as
it likes, through the real pipeline. What a user cares about: honest updates keep their weight
and size, the stranger gets about its fair share, and replicas decide alike.
"""

from __future__ import annotations

import functools
import hashlib
import math
import statistics
from collections.abc import Callable

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.envelope import SignedUpdate
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, MergeResult, UpdatePipeline
from merge.replica import Replica
from merge.robust import RobustConfig, RobustFilter
from merge.weighting import TokenWeightConfig
from tests.factories import MALLORY, identity, sealed_update

FINGERPRINT = hashlib.sha256(b"open").hexdigest()
HONEST = [identity(bytes([104 + i])) for i in range(3)]
SYBILS = [Identity.from_private_bytes(hashlib.sha256(b"%d" % i).digest()) for i in range(40)]
NUMEL, M = 64, 3
CONFIG = MergeConfig(
    outer=OuterConfig(kind="delayed_nesterov", lr=0.7, momentum=0.9),
    token_weight=TokenWeightConfig(reference_tokens=1000),
    max_inner_steps=100,
    max_tokens_per_step=100,
)

DIRECTION = torch.linspace(-1, 1, NUMEL) / torch.linspace(-1, 1, NUMEL).norm()


def make_pipeline() -> UpdatePipeline:
    replica = Replica(torch.full((NUMEL,), 10.0), make_outer_optimizer(CONFIG.outer, NUMEL))
    pipeline = UpdatePipeline(replica, CONFIG, FINGERPRINT)
    pipeline.clock = lambda: 1000.0
    return pipeline


def update(identity: Identity, seq: int, delta: torch.Tensor, learners: int = M) -> SignedUpdate:
    return sealed_update(
        identity, delta=delta, fingerprint=FINGERPRINT, seq=seq, published_applied=M - 1,
        created_at=999.0, learners=learners,
    )  # fmt: skip


def honest_delta(author: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * author + seq)
    return 0.1 * (DIRECTION + 0.3 * torch.randn(NUMEL, generator=g) / NUMEL**0.5)


@functools.cache
def honest_update(author: int, seq: int) -> SignedUpdate:
    """Honest author `author`'s update `seq`, sealed once per session (frozen: every pipeline
    still verifies it; signing was a third of building an established pipeline)."""
    return update(HONEST[author], seq, honest_delta(author, seq))


def honest_round(
    pipeline: UpdatePipeline, seq: int, order: tuple[int, ...] = (0, 1, 2)
) -> list[MergeResult]:
    return [pipeline.submit(honest_update(i, seq)) for i in order]


def established(rounds: int = 12) -> UpdatePipeline:
    pipeline = make_pipeline()
    for seq in range(rounds):
        assert all(r.accepted for r in honest_round(pipeline, seq))
    assert all(pipeline.ledger.is_established(h.peer_id) for h in HONEST)
    return pipeline


class Contributions:
    """What each applied update moved the replica by (weight / learners times the vector the
    replica was given): a spy around the real Replica.apply."""

    def __init__(self, pipeline: UpdatePipeline) -> None:
        self.by_author: dict[str, torch.Tensor] = {}
        apply = pipeline.replica.apply

        def spy(header, g, weight, norm=None, *, learners=None, credited=1.0):  # type: ignore[no-untyped-def]
            if weight:
                share = (weight / learners) * g.double()
                total = self.by_author.get(header.author, torch.zeros(NUMEL, dtype=torch.float64))
                self.by_author[header.author] = total + share
            apply(header, g, weight, norm, learners=learners, credited=credited)

        pipeline.replica.apply = spy  # type: ignore[method-assign,assignment]

    def of(self, authors: list[str]) -> torch.Tensor:
        zero = torch.zeros(NUMEL, dtype=torch.float64)
        return sum((self.by_author.get(a, zero) for a in authors), zero)


def test_a_flood_of_zero_updates_does_not_stall_honest_training() -> None:
    pipeline = established()
    reference = pipeline.robust.median_norm()
    assert reference is not None
    for seq in range(200):  # 200 valid all-zero updates, far more than the robust window
        assert pipeline.submit(update(MALLORY, seq, torch.zeros(NUMEL))).accepted

    results = honest_round(pipeline, 12)

    assert [r.robust for r in results] == [None, None, None]  # not clipped to nothing
    assert min(r.weight for r in results) > 0.9
    after = pipeline.robust.median_norm()
    assert after is not None and after > 0.5 * reference


def test_the_reference_recovers_from_a_zero_flood_in_a_young_swarm() -> None:
    """Before anyone has a track record every author votes; the flood's one vote sits at the
    low end of the band, and honest updates still pass once it stops."""
    pipeline = make_pipeline()
    honest_round(pipeline, 0)
    for seq in range(64):
        pipeline.submit(update(MALLORY, seq, torch.zeros(NUMEL)))
    results = [r for seq in range(1, 4) for r in honest_round(pipeline, seq)]
    assert all(r.robust is None and r.weight > 0.9 for r in results)


def test_sybils_claiming_huge_learner_counts_do_not_dilute_honest_updates() -> None:
    pipeline = established()
    for seq in range(2):
        for sybil in SYBILS:
            assert pipeline.submit(update(sybil, seq, honest_delta(9, seq), learners=1024)).accepted
    results = honest_round(pipeline, 12)
    assert [r.learners for r in results] == [M, M, M]  # 42 before issue 20


def test_sybils_claiming_one_learner_buy_no_whole_outer_step() -> None:
    pipeline = established()
    result = pipeline.submit(update(SYBILS[0], 0, honest_delta(9, 0), learners=1))
    assert result.learners == M


def test_a_sideways_near_cap_update_keeps_at_most_an_honest_sized_deviation() -> None:
    robust, config = RobustFilter(RobustConfig()), RobustConfig()
    for seq in range(8):
        robust.record(robust.judge(honest_delta(0, seq), None), "honest")
    reference = robust.median_norm()
    assert reference is not None
    momentum = DIRECTION.clone()
    side = torch.randn(NUMEL, generator=torch.Generator().manual_seed(5))
    side -= torch.dot(side, DIRECTION) * DIRECTION
    cos = -0.45  # just above the refusal bound
    attack = 3.9 * reference * (cos * DIRECTION + math.sqrt(1 - cos**2) * side / side.norm())

    for fresh, radius in ((True, config.fresh_center_radius), (False, config.center_radius)):
        verdict = robust.judge(attack, momentum, fresh=fresh)
        clipped = robust.clipped(attack, [momentum], verdict)
        assert verdict.reason == "off_center"
        deviation = float((clipped - reference * DIRECTION).norm())
        assert deviation <= radius * reference * (1 + 1e-5)
        assert float(clipped.norm()) <= (1 + radius) * reference * (1 + 1e-5)


def test_honest_updates_are_not_recentered() -> None:
    pipeline = established()
    results = [r for seq in range(12, 30) for r in honest_round(pipeline, seq)]
    assert all(r.robust is None and r.weight > 0.9 for r in results)


adversary = st.tuples(
    st.sampled_from(["zero", "sideways", "against", "huge", "along"]),
    st.integers(0, 12),  # updates after this honest update
    st.sampled_from([1, 3, 1024]),  # learners claimed
)


def hostile(kind: str, seq: int) -> torch.Tensor:
    side = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seq))
    side -= torch.dot(side, DIRECTION) * DIRECTION
    side = side / side.norm()
    vectors: dict[str, Callable[[], torch.Tensor]] = {
        "zero": lambda: torch.zeros(NUMEL),
        "sideways": lambda: 0.39 * (-0.45 * DIRECTION + 0.89 * side),
        "against": lambda: -0.1 * DIRECTION,
        "huge": lambda: 5.0 * side,
        "along": lambda: 0.39 * DIRECTION,
    }
    return vectors[kind]()


@settings(max_examples=25, deadline=None)
@given(attacks=st.lists(adversary, min_size=1, max_size=24))
def test_one_authors_updates_leave_the_honest_contribution_within_bounds(
    attacks: list[tuple[str, int, int]],
) -> None:
    """For any sequence of one author's updates interleaved with honest ones, the honest
    authors' total contribution stays within bounds of what it is with no adversary, and the
    adversary's stays within its budget of one fair share (the honest progress per author)."""
    clean, attacked = established(), established()
    clean_spy, attacked_spy = Contributions(clean), Contributions(attacked)
    mallory_seq = 0
    for i, (kind, count, learners) in enumerate(attacks):
        seq, author = 12 + i // M, i % M
        for pipeline in (clean, attacked):
            assert pipeline.submit(honest_update(author, seq)).accepted
        for _ in range(count):
            vector = hostile(kind, mallory_seq)
            assert attacked.submit(update(MALLORY, mallory_seq, vector, learners)).accepted
            mallory_seq += 1
    honest_ids = [h.peer_id for h in HONEST]
    honest_clean, honest_attacked = clean_spy.of(honest_ids), attacked_spy.of(honest_ids)
    scale = float(honest_clean.norm())
    assert float((honest_attacked - honest_clean).norm()) <= 0.15 * scale
    # The stranger: its cap (fresh_share fair shares, more once it has a track record) of
    # the honest progress plus the budget's initial room, in rounds; each round-share of at
    # most (1 + center_radius) reference norms, about what a round of honest updates moves.
    budget, robust = CONFIG.robust.budget, CONFIG.robust
    cap = attacked.ledger.cap(MALLORY.peer_id, M)
    rounds = cap / (M - 1) * (len(attacks) / M + budget.budget_rounds)
    per_round = scale / (len(attacks) / M)  # what one round of the honest authors moved
    bound = rounds * (1 + robust.center_radius) * per_round * 1.2  # the reference varies
    assert float(attacked_spy.of([MALLORY.peer_id]).norm()) <= bound


@settings(max_examples=25, deadline=None)
@given(orders=st.lists(st.permutations([0, 1, 2]), min_size=4, max_size=10))
def test_replicas_fed_a_round_in_another_order_decide_identically(
    orders: list[list[int]],
) -> None:
    """Arrival order within a round differs between replicas: verdicts, weights and sizes are
    the same, and their params settle to the same point (they differ by the momentum tail)."""
    one, other = established(), established()
    mallory = update(MALLORY, 0, hostile("sideways", 0))
    decided: dict[str, dict[tuple[str, int], tuple[object, ...]]] = {"one": {}, "other": {}}
    for i, order in enumerate(orders):
        seq = 12 + i
        for name, pipeline, permutation in (
            ("one", one, (0, 1, 2)),
            ("other", other, tuple(order)),
        ):
            for r in honest_round(pipeline, seq, permutation):
                decided[name][(r.author, r.seq)] = (r.weight, r.learners, r.robust)
        if i == 1:
            for name, pipeline in (("one", one), ("other", other)):
                r = pipeline.submit(mallory)
                decided[name][(r.author, r.seq)] = (r.weight, r.learners, r.robust)
    assert decided["one"] == decided["other"]
    assert one.replica.applied_digest() == other.replica.applied_digest()
    everything = torch.arange(NUMEL)
    settled = one.replica.settled_at(everything)
    assert torch.allclose(settled, other.replica.settled_at(everything), atol=1e-5)


def test_the_merge_state_carries_the_ledger_and_old_states_load() -> None:
    donor = established()
    state = donor.state_dict()
    assert "ledger" in state
    restored = make_pipeline()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    old = {k: v for k, v in state.items() if k != "ledger"}
    old["robust"] = [{"norms": r["norms"]} for r in state["robust"]]  # type: ignore[attr-defined]
    from_old = make_pipeline()
    from_old.load_state_dict(old)  # a checkpoint from before issue 20
    assert not from_old.ledger.any_established()
    norms = state["robust"][0]["norms"]  # type: ignore[index]
    window = CONFIG.robust.window  # one anonymous voter: the median of the last window
    assert from_old.robust.median_norm() == statistics.median(norms[-window:])


@settings(max_examples=8, deadline=None)
@given(floods=st.lists(st.integers(0, 40), min_size=1, max_size=10))
def test_a_zero_flood_does_not_make_honest_updates_stale(floods: list[int]) -> None:
    """An author's header counts what its replica applied during its round in credited
    progress (Replica.progress): a flood of zeros interleaved with the honest rounds adds
    nothing to an honest author's staleness (zeros have no substance; 4-5.5 rounds stale in
    bench.attack before, 1 clean), and never more than the flooder's budget (cap / (M - 1)
    rounds of each round, plus its initial room)."""
    clean, attacked = established(), established()
    extra, mallory_seq = 0, 0
    for i, count in enumerate(floods):
        seq = 12 + i
        bases = (clean.replica.progress, attacked.replica.progress)
        honest_round(clean, seq)
        honest_round(attacked, seq)
        for _ in range(count):
            assert attacked.submit(update(MALLORY, mallory_seq, torch.zeros(NUMEL))).accepted
            mallory_seq += 1
        clean_staleness = clean.replica.progress - bases[0]
        assert clean_staleness == M  # the round's own updates: nothing beyond them
        extra += attacked.replica.progress - bases[1] - clean_staleness
    budget = CONFIG.robust.budget
    cap = attacked.ledger.cap(MALLORY.peer_id, M)
    credited = cap / (M - 1) * (len(floods) + budget.budget_rounds) * M  # in updates
    assert 0 <= extra <= credited + 1
    assert extra == 0  # zeros are no progress at all
    assert attacked.replica.num_applied - clean.replica.num_applied == sum(floods)


def test_sybils_from_the_swarms_first_update_earn_no_record_and_count_as_no_learner() -> None:
    """40 Sybil keys claiming 1,024 learners from the first round on (before anyone has a
    track record, when every claim still votes): a claim beyond what the replica sees earns
    record only in proportion (authors seen / claim), so the honest authors establish and the
    Sybils stay fresh, without a whole update's record: then the floor ignores them and the
    live learner count counts them as no learner (no honest update shrinks for them)."""
    pipeline = make_pipeline()
    for seq in range(12):
        honest_round(pipeline, seq)
        for sybil in SYBILS:
            assert pipeline.submit(update(sybil, seq, honest_delta(9, seq), learners=1024)).accepted
    assert all(pipeline.ledger.is_established(h.peer_id) for h in HONEST)
    assert not any(pipeline.ledger.is_established(s.peer_id) for s in SYBILS)
    assert [r.learners for r in honest_round(pipeline, 12)] == [M, M, M]
    peers = {h.peer_id for h in HONEST[1:]} | {s.peer_id for s in SYBILS}
    assert pipeline.credited_learners(peers) == M - 1  # the Sybils: no learner


def test_a_stranger_flooding_before_the_founders_arrive_earns_no_record_from_it() -> None:
    """A flooder that publishes before it sees anyone claims one learner: alone, its updates
    are whole (there is no one to take a share from) but earn no record, so once the founders
    arrive its record is what its budget lets through beside them, not its head start
    (bench.attack zero_flood: 1.73x while alone updates earned record)."""
    pipeline = make_pipeline()
    mallory_seq = 0
    for _ in range(50):
        assert pipeline.submit(update(MALLORY, mallory_seq, torch.zeros(NUMEL), 1)).accepted
        mallory_seq += 1
    assert pipeline.ledger.record(MALLORY.peer_id) == 0.0
    for seq in range(12):
        honest_round(pipeline, seq)
        for _ in range(4):
            pipeline.submit(update(MALLORY, mallory_seq, torch.zeros(NUMEL), M + 1))
            mallory_seq += 1
    assert all(pipeline.ledger.is_established(h.peer_id) for h in HONEST)
    budget = CONFIG.robust.budget  # fresh_share fair shares of 12 rounds, and its burst room
    bound = budget.fresh_share * M / (M - 1) * (12 + budget.budget_rounds)
    assert pipeline.ledger.record(MALLORY.peer_id) <= bound < 50


def test_zero_updates_take_no_share_of_the_outer_round() -> None:
    """Zeros move nothing and, of no substance, are stepped as nothing: they do not advance
    the outer round either, so a flood of them between honest rounds leaves the replica where
    the honest rounds alone take it (they folded the momentum several times per honest
    update before: bench.attack zero_flood 1.4-2.7x)."""
    clean, attacked = established(), established()
    for seq in range(12, 16):
        honest_round(clean, seq)
        honest_round(attacked, seq)
        for i in range(40):
            result = attacked.submit(update(MALLORY, 40 * (seq - 12) + i, torch.zeros(NUMEL)))
            assert result.accepted and result.weight == 0.0
    assert torch.equal(clean.replica.params, attacked.replica.params)


@settings(max_examples=30, deadline=None)
@given(st.floats(0.03, 1.0))
def test_a_short_honest_round_keeps_its_whole_share_of_the_outer_round(fraction: float) -> None:
    """A learner three times slower sends a round of a third of the steps: a smaller norm, but
    no speck. It is weighed by its header (tokens, staleness) exactly as a whole round is, and
    steps as much of the outer round (zeros take none: the test above)."""
    whole, short = established(), established()
    delta = honest_delta(0, 12)
    full = whole.submit(update(HONEST[0], 12, delta))
    part = short.submit(update(HONEST[0], 12, fraction * delta))
    assert full.accepted and part.accepted
    assert part.weight == full.weight > 0
    assert part.learners == full.learners
