"""A flush update (merge.envelope's signed flush marker): a stopping node's residual, applied
as a plain outer step with no momentum, alike on every replica and in any arrival order.

The flush through the outer optimizer as one more round folded the momentum in once more,
which overshot at the end of a run (docs/codecs.md: topk at M = 2, H = 100 ended 1.054x
bf16 after such a flush; as a plain step the same residuals gave 0.973x).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.envelope import (
    EnvelopeError,
    SignedHeader,
    SignedUpdate,
    UpdateHeader,
    verify_header,
)
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.weighting import TokenWeightConfig
from tests.factories import ALICE, Decisions, sealed_update, submit_in_order

FINGERPRINT = hashlib.sha256(b"flush").hexdigest()
AUTHORS = [
    Identity.from_private_bytes(hashlib.sha256(b"flusher %d" % i).digest()) for i in range(4)
]
NUMEL = 48
DIRECTION = torch.linspace(-1, 1, NUMEL) / torch.linspace(-1, 1, NUMEL).norm()


def config(kind: str) -> MergeConfig:
    return MergeConfig(
        outer=OuterConfig(kind=kind, lr=0.7, momentum=0.9),  # type: ignore[arg-type]
        token_weight=TokenWeightConfig(reference_tokens=1000),
        max_inner_steps=100,
        max_tokens_per_step=100,
    )


def delta(author: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * author + seq)
    return 0.1 * (DIRECTION + 0.3 * torch.randn(NUMEL, generator=g) / NUMEL**0.5)


# -- the marker on the wire -------------------------------------------------------------------


def test_a_flush_header_round_trips_and_says_so_in_its_signed_bytes() -> None:
    update = sealed_update(ALICE, delta=[1.0, 2.0], seq=3, learners=2, flush=True)

    parsed = SignedUpdate.from_bytes(update.to_bytes())

    assert parsed == update and parsed.header.flush and parsed.header.version == 3
    assert json.loads(update.header.canonical_bytes())["flush"] is True
    verify_header(parsed.signed_header)


def test_a_fragment_flush_is_a_v4_header_with_the_marker() -> None:
    update = sealed_update(ALICE, delta=[1.0], fragment=1, fragments=3, flush=True)

    parsed = SignedHeader.from_bytes(update.signed_header.to_bytes())

    assert parsed.header.flush and parsed.header.version == 4


def test_a_header_without_the_marker_keeps_the_bytes_it_always_had() -> None:
    update = sealed_update(ALICE, delta=[1.0, 2.0], seq=3)

    assert "flush" not in json.loads(update.header.canonical_bytes())
    assert not SignedUpdate.from_bytes(update.to_bytes()).header.flush


def test_the_marker_is_signed_added_or_dropped_it_breaks_the_signature() -> None:
    plain = sealed_update(ALICE, delta=[1.0], seq=1)
    flush = sealed_update(ALICE, delta=[1.0], seq=1, flush=True)
    added = SignedHeader(dataclasses.replace(plain.header, flush=True), plain.signature)
    dropped = SignedHeader(dataclasses.replace(flush.header, flush=False), flush.signature)

    for forged in (added, dropped):
        with pytest.raises(EnvelopeError) as excinfo:
            verify_header(SignedHeader.from_bytes(forged.to_bytes()))
        assert excinfo.value.reason == "bad_signature"


@pytest.mark.parametrize("value", [False, 1, "true", None, 0])
def test_a_marker_other_than_true_is_malformed(value: object) -> None:
    d = sealed_update(ALICE, delta=[1.0]).header.to_dict() | {"flush": value}
    header_json = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    blob = b"DLH1" + struct.pack("<I", len(header_json)) + header_json + bytes(64)

    for parse in (lambda: UpdateHeader.from_dict(d), lambda: SignedHeader.from_bytes(blob)):
        with pytest.raises(EnvelopeError) as excinfo:
            parse()
        assert excinfo.value.reason == "malformed"


def test_a_v1_or_v2_header_cannot_carry_the_marker() -> None:
    header = sealed_update(ALICE, delta=[1.0]).header
    v2 = dataclasses.replace(header, payload_blake3=None, payload_sha256="0" * 64)
    d = v2.to_dict() | {"flush": True}

    with pytest.raises(EnvelopeError, match="malformed"):
        UpdateHeader.from_dict(d)
    with pytest.raises(EnvelopeError, match="malformed"):
        dataclasses.replace(v2, flush=True)


# -- the outer step ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["nesterov", "delayed_nesterov"]),
    seed=st.integers(0, 2**32 - 1),
    before=st.integers(0, 5),
    weight=st.floats(0.0, 2.0),
    learners=st.integers(1, 8),
)
def test_a_flush_moves_the_params_by_its_weighted_share_and_touches_no_momentum(
    kind: str, seed: int, before: int, weight: float, learners: int
) -> None:
    outer = make_outer_optimizer(config(kind).outer, NUMEL)
    g = torch.Generator().manual_seed(seed)
    params = torch.randn(NUMEL, generator=g)
    for _ in range(before):  # some momentum and a part-done round to leave alone
        outer.step(params, torch.randn(NUMEL, generator=g), 1.0, learners)
    state = outer.state_dict()
    flush = torch.randn(NUMEL, generator=g)
    expected = params.double() - 0.7 * weight / learners * flush.double()

    moved = outer.plain_step(params, flush, weight, learners)

    assert moved == pytest.approx(0.7 * weight / learners)
    torch.testing.assert_close(params.double(), expected, rtol=0, atol=1e-5)
    after = outer.state_dict()
    assert after.keys() == state.keys()
    for key, value in state.items():
        now = after[key]
        assert torch.equal(now, value) if isinstance(value, torch.Tensor) else now == value


@pytest.mark.parametrize("kind", ["nesterov", "delayed_nesterov"])
def test_a_flush_through_the_pipeline_moves_the_replica_by_exactly_its_weighted_delta(
    kind: str,
) -> None:
    replica = Replica(torch.full((NUMEL,), 10.0), make_outer_optimizer(config(kind).outer, NUMEL))
    pipeline = UpdatePipeline(replica, config(kind), FINGERPRINT)
    for seq in range(3):
        for author in range(2):
            update = sealed_update(
                AUTHORS[author], delta=delta(author, seq), fingerprint=FINGERPRINT, seq=seq,
                created_at=1000.0 + 10 * seq, learners=2, published_applied=2 * seq,
                base_applied=2 * seq,
            )  # fmt: skip
            assert pipeline.submit(update).accepted
    before, momentum = replica.params.clone(), replica.outer.state_dict()
    residual = delta(0, 99)
    flush = sealed_update(
        AUTHORS[0], delta=residual, fingerprint=FINGERPRINT, seq=3, created_at=1040.0,
        learners=2, base_applied=6, published_applied=6, flush=True,
    )  # fmt: skip

    result = pipeline.submit(flush)

    assert result.accepted and result.robust is None and result.weight > 0
    expected = before.double() - 0.7 * result.weight / result.learners * residual.double()
    torch.testing.assert_close(replica.params.double(), expected, rtol=0, atol=1e-5)
    for key, value in momentum.items():
        now = replica.outer.state_dict()[key]
        assert torch.equal(now, value) if isinstance(value, torch.Tensor) else now == value


def test_a_flush_is_weighed_like_the_same_update_without_the_marker() -> None:
    """The bound on abuse: every check a pipeline makes (norms, robust verdicts, budgets,
    learner floor) sees a flush as the update it would be without the marker, so the marker
    buys no larger weight; it only drops the momentum on top of the plain share."""
    results = {}
    for flush in (False, True):
        outer = make_outer_optimizer(config("delayed_nesterov").outer, NUMEL)
        replica = Replica(torch.full((NUMEL,), 10.0), outer)
        pipeline = UpdatePipeline(replica, config("delayed_nesterov"), FINGERPRINT)
        for seq in range(13):  # past the robust warm-up; the last one 6x the norm
            update = sealed_update(
                AUTHORS[1], delta=delta(1, seq) * (6.0 if seq == 12 else 1.0),
                fingerprint=FINGERPRINT, seq=seq, created_at=1000.0 + 10 * seq,
                flush=flush and seq == 12,
            )  # fmt: skip
            r = pipeline.submit(update)
            assert r.accepted
        results[flush] = (r.weight, r.learners, r.robust)
    assert results[True] == results[False]
    assert results[True][2] == "norm_outlier"  # clipped alike, marker or not


def test_withdrawing_a_flush_takes_back_exactly_its_step() -> None:
    outer = make_outer_optimizer(config("nesterov").outer, NUMEL)
    replica = Replica(torch.full((NUMEL,), 1.0), outer)
    first = sealed_update(AUTHORS[0], delta=delta(0, 0), fingerprint=FINGERPRINT, seq=0)
    replica.apply(first.header, delta(0, 0), 1.0, learners=1)
    before, momentum = replica.params.clone(), outer.momentum_buffer.clone()
    flush = sealed_update(AUTHORS[0], delta=delta(0, 1), fingerprint=FINGERPRINT, seq=1, flush=True)

    replica.apply(flush.header, delta(0, 1), 0.8, learners=2)
    replica.withdraw(flush.header, delta(0, 1), 0.8, learners=2)

    torch.testing.assert_close(replica.params, before, rtol=0, atol=1e-6)
    assert torch.equal(outer.momentum_buffer, momentum)


# -- arrival order ------------------------------------------------------------------------------


def swarm(rng: random.Random, rounds: int, flushers: list[int]) -> list[SignedUpdate]:
    """Four authors publish `rounds` rounds (each claiming 4 learners); the `flushers` then
    stop, each sending one flush."""
    updates = []
    for seq in range(rounds):
        for author in range(4):
            t = 1000.0 + 10 * seq + rng.uniform(0, 5)
            updates.append(
                sealed_update(
                    AUTHORS[author],
                    delta=delta(author, seq),
                    fingerprint=FINGERPRINT,
                    seq=seq,
                    created_at=t,
                    learners=4,
                    base_applied=4 * seq,
                    published_applied=4 * seq,
                )  # fmt: skip
            )
    for author in flushers:
        updates.append(
            sealed_update(
                AUTHORS[author],
                delta=delta(author, 500),
                fingerprint=FINGERPRINT,
                seq=rounds,
                created_at=1000.0 + 10 * rounds,
                learners=4,
                base_applied=4 * rounds,
                published_applied=4 * rounds,
                flush=True,
            )  # fmt: skip
        )
    return updates


def replay(
    kind: str, updates: list[SignedUpdate], order: list[int]
) -> tuple[UpdatePipeline, Decisions]:
    replica = Replica(torch.full((NUMEL,), 10.0), make_outer_optimizer(config(kind).outer, NUMEL))
    pipeline = UpdatePipeline(replica, config(kind), FINGERPRINT)
    pipeline.clock = lambda: 5000.0
    return pipeline, submit_in_order(pipeline, updates, order)


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(["nesterov", "delayed_nesterov"]),
    seed=st.integers(0, 2**32 - 1),
    rounds=st.integers(1, 4),
    flushers=st.lists(st.integers(0, 3), min_size=1, max_size=4, unique=True),
)
def test_replicas_applying_flushes_in_other_orders_agree(
    kind: str, seed: int, rounds: int, flushers: list[int]
) -> None:
    """Each replica gets the rounds and the flushes shuffled (a flush may overtake updates
    published before it): they decide alike and settle to one point, and the flushes moved
    that point by exactly their weighted deltas, with no momentum on them."""
    rng = random.Random(seed)
    updates = swarm(rng, rounds, flushers)
    plain = [u for u in updates if not u.header.flush]
    orders = [rng.sample(range(len(updates)), len(updates)) for _ in range(2)]
    (one, decided), (other, decided_other) = (replay(kind, updates, order) for order in orders)
    without, decided_without = replay(kind, plain, list(range(len(plain))))

    assert decided == decided_other
    assert {k: v for k, v in decided.items() if k[1] < rounds} == decided_without
    assert one.replica.applied_digest() == other.replica.applied_digest()
    everything = torch.arange(NUMEL)
    settled = one.replica.settled_at(everything)
    torch.testing.assert_close(settled, other.replica.settled_at(everything), rtol=0, atol=1e-5)
    moved = torch.zeros(NUMEL, dtype=torch.float64)
    for author in flushers:
        weight, learners, robust = decided[(AUTHORS[author].peer_id, rounds)]
        assert robust is None
        moved += 0.7 * weight / learners * delta(author, 500).double()
    expected = without.replica.settled_at(everything) - moved
    torch.testing.assert_close(settled, expected, rtol=0, atol=1e-5)
