import dataclasses
import hashlib
import json
import threading
from typing import Any

import pytest
import torch

from merge.correction import CorrectionConfig
from merge.envelope import SignedUpdate
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, MergeResult, UpdatePipeline
from merge.replica import Replica
from merge.robust import RobustConfig
from merge.weighting import StalenessConfig, TokenWeightConfig
from tests.factories import ALICE, FINGERPRINT, encoded, identity, sealed_update

BOB = identity("b")
START = [1.0, 2.0, 3.0, 4.0]  # norm sqrt(30) ~ 5.48
DELTA = [0.5, 0.0, -0.5, 1.0]
CONFIG = MergeConfig(
    outer=OuterConfig(kind="nesterov", lr=0.5, momentum=0.5),
    staleness=StalenessConfig(kind="polynomial", a=0.5),
    token_weight=TokenWeightConfig(reference_tokens=1000),
    max_inner_steps=100,
    max_tokens_per_step=100,
)


def make_pipeline(config: MergeConfig = CONFIG) -> UpdatePipeline:
    replica = Replica(torch.tensor(START), make_outer_optimizer(config.outer, len(START)))
    return UpdatePipeline(replica, config, FINGERPRINT)


def make_update(
    identity: Identity = ALICE, delta: list[float] = DELTA, **overrides: Any
) -> SignedUpdate:
    fields: dict[str, Any] = {
        "fingerprint": FINGERPRINT,
        "base_applied": 10,
        "published_applied": 13,  # staleness 3 -> weight (1+3)^-0.5 = 0.5
        "tokens": 500,  # 500 / 1000 reference tokens -> weight 0.5
        "numel": len(delta),
    }
    fields.update(overrides)
    if fields.get("payload") is None:
        fields["payload"] = encoded(delta, fields.get("codec", "fp32"))
    return sealed_update(identity, **fields)


def test_accepted_update_moves_params_by_the_weighted_nesterov_step() -> None:
    pipeline = make_pipeline()

    result = pipeline.submit(make_update())

    assert result == MergeResult(True, ALICE.peer_id, 0, 3, 0.25, None, inner_steps=10)
    # w = 0.5 * 0.5; g' = w*DELTA = [0.125, 0, -0.125, 0.25]; p -= lr * (1 + m) * g'
    assert pipeline.replica.params.tolist() == [0.90625, 2.0, 3.09375, 3.8125]
    assert pipeline.num_merged == 1 and pipeline.replica.num_applied == 1
    assert not pipeline.rejections


def test_an_update_of_the_current_swarm_round_is_not_discounted_as_stale() -> None:
    pipeline = make_pipeline()
    # Sized by 4 learners, 3 others merged during its round: a round's peers, not staleness.
    concurrent = make_update(learners=4)
    late = make_update(published_applied=17, learners=4)  # 7 = 3 + one whole round missed

    assert pipeline.weight_of(concurrent.header) == 0.5  # tokens only
    assert pipeline.weight_of(late.header) == pytest.approx(0.5 * 2**-0.5)


def test_weight_comes_from_the_signed_header_only() -> None:
    pipeline = make_pipeline()

    fresh = pipeline.submit(make_update(seq=0, base_applied=5, published_applied=5, tokens=1000))
    stale = pipeline.submit(make_update(BOB, seq=0, base_applied=0, published_applied=8))

    assert fresh.weight == 1.0  # staleness 0, a full reference round
    assert stale.weight == pytest.approx((1 + 8) ** -0.5 * 0.5)


def test_bf16_update_is_applied_as_decoded() -> None:
    pipeline = make_pipeline()
    delta = [0.3, -0.2, 0.1, 0.05]

    assert pipeline.submit(make_update(delta=delta, codec="bf16")).accepted

    decoded = torch.tensor(delta).to(torch.bfloat16).float()
    expected = torch.tensor(START) - 0.5 * 1.5 * (decoded * 0.25)
    assert torch.allclose(pipeline.replica.params, expected, rtol=0, atol=1e-6)


def assert_rejected(pipeline: UpdatePipeline, update: SignedUpdate, reason: str) -> None:
    params_before, applied_before = pipeline.replica.snapshot()
    count_before = pipeline.rejections[reason]

    result = pipeline.submit(update)

    assert (result.accepted, result.reason, result.weight) == (False, reason, 0.0)
    assert pipeline.rejections[reason] == count_before + 1
    assert torch.equal(pipeline.replica.params, params_before)
    assert pipeline.replica.num_applied == applied_before


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"fingerprint": hashlib.sha256(b"other run").hexdigest()}, "wrong_run"),
        ({"codec": "int3", "payload": b"\x00" * 2}, "unknown_codec"),
        ({"numel": 5, "delta": [0.1] * 5}, "wrong_size"),
        ({"seq": -1}, "bad_counters"),
        ({"base_applied": -1, "published_applied": 0}, "bad_counters"),
        ({"base_applied": 14, "published_applied": 13}, "bad_counters"),
        ({"inner_steps": 0}, "bad_steps"),
        ({"inner_steps": 101, "tokens": 500}, "bad_steps"),
        ({"tokens": 0}, "bad_tokens"),
        ({"inner_steps": 10, "tokens": 1001}, "bad_tokens"),
        ({"loss": float("nan")}, "non_finite"),
        ({"base_applied": 0, "published_applied": 1001}, "too_stale"),
        ({"delta": [0.1, float("nan"), 0.0, 0.0]}, "non_finite"),
        ({"delta": [0.1, float("inf"), 0.0, 0.0]}, "non_finite"),
        ({"delta": [10.0, 0.0, 0.0, 0.0]}, "norm_too_large"),
        ({"codec": "bf16", "payload": b"\x00" * 6}, "malformed"),
        ({"learners": 0}, "bad_learners"),
        ({"learners": 1025}, "bad_learners"),
        ({"learners": -3}, "bad_learners"),
    ],
)
def test_invalid_updates_are_rejected_counted_and_change_nothing(
    overrides: dict[str, Any], reason: str
) -> None:
    pipeline = make_pipeline()

    assert_rejected(pipeline, make_update(**overrides), reason)


def test_replayed_update_is_a_duplicate() -> None:
    pipeline = make_pipeline()
    update = make_update(seq=4)
    assert pipeline.submit(update).accepted

    assert_rejected(pipeline, update, "duplicate")
    assert_rejected(pipeline, SignedUpdate.from_bytes(update.to_bytes()), "duplicate")


def test_a_late_update_is_applied_after_a_later_one_of_its_author_exactly_once() -> None:
    pipeline = make_pipeline()
    assert pipeline.submit(make_update(seq=4)).accepted

    assert pipeline.submit(make_update(seq=3)).accepted
    assert_rejected(pipeline, make_update(seq=3), "duplicate")
    assert pipeline.replica.applied == {ALICE.peer_id: [3, 4]}


def test_tampered_payload_is_a_hash_mismatch() -> None:
    update = make_update()
    tampered = SignedUpdate(update.header, update.signature, b"\x00" * len(update.payload))

    assert_rejected(make_pipeline(), tampered, "payload_hash_mismatch")


def test_forged_header_is_a_bad_signature() -> None:
    update = make_update(base_applied=0, published_applied=50)
    fresher = dataclasses.replace(update.header, base_applied=50)  # claims staleness 0
    forged = SignedUpdate(fresher, update.signature, update.payload)
    impostor = make_update(BOB)
    stolen_name = dataclasses.replace(impostor.header, author=ALICE.peer_id)

    pipeline = make_pipeline()
    assert_rejected(pipeline, forged, "bad_signature")
    assert_rejected(pipeline, SignedUpdate(stolen_name, impostor.signature, b""), "bad_signature")


def test_check_header_judges_announcements_without_counting() -> None:
    pipeline = make_pipeline()
    update = make_update()

    assert pipeline.check_header(update.signed_header) is None
    assert pipeline.submit(update).accepted
    assert pipeline.check_header(update.signed_header) == "duplicate"
    assert pipeline.check_header(make_update(fingerprint="0" * 64).signed_header) == "wrong_run"
    assert not pipeline.rejections


def test_concurrent_submissions_of_one_update_apply_it_once() -> None:
    pipeline = make_pipeline()
    update = make_update()
    barrier = threading.Barrier(8)
    results: list[MergeResult] = []

    def submit() -> None:
        barrier.wait(timeout=5)
        results.append(pipeline.submit(update))

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=5)

    assert sorted(r.reason or "accepted" for r in results) == ["accepted"] + ["duplicate"] * 7
    assert pipeline.num_merged == 1 and pipeline.rejections["duplicate"] == 7
    assert pipeline.replica.params.tolist() == [0.90625, 2.0, 3.09375, 3.8125]


def test_concurrent_authors_are_all_applied() -> None:
    pipeline = make_pipeline()
    updates = [make_update(identity(bytes([i]))) for i in range(16)]

    threads = [threading.Thread(target=pipeline.submit, args=(u,)) for u in updates]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=5)

    assert pipeline.num_merged == pipeline.replica.num_applied == 16
    assert len(pipeline.replica.applied) == 16


def test_merge_config_is_plain_json_and_validated() -> None:
    as_dict = CONFIG.as_dict()

    assert json.loads(json.dumps(as_dict)) == as_dict
    assert as_dict["outer"]["kind"] == "nesterov"
    assert as_dict["token_weight"]["reference_tokens"] == 1000
    with pytest.raises(ValueError):
        dataclasses.replace(CONFIG, max_inner_steps=0)
    with pytest.raises(ValueError):
        dataclasses.replace(CONFIG, max_update_norm_ratio=0.0)
    with pytest.raises(ValueError):
        UpdatePipeline(make_pipeline().replica, CONFIG, "not-a-fingerprint")


SWARM = [identity(bytes([i + 1])) for i in range(16)]


@pytest.mark.parametrize("kind", ["nesterov", "delayed_nesterov"])
@pytest.mark.parametrize("learners", [1, 2, 4, 8, 16])
def test_a_round_of_m_equal_updates_is_one_sync_diloco_step(kind: str, learners: int) -> None:
    """M learners, each publishing one full, fresh update per round, through the real path."""
    config = dataclasses.replace(
        CONFIG,
        outer=OuterConfig(kind=kind, lr=0.7, momentum=0.9),  # type: ignore[arg-type]
        token_weight=TokenWeightConfig(reference_tokens=1000),
    )
    generator = torch.Generator().manual_seed(learners)
    start = torch.randn(64, generator=generator)
    replica = Replica(start.clone(), make_outer_optimizer(config.outer, 64))
    pipeline = UpdatePipeline(replica, config, FINGERPRINT)
    reference = torch.nn.Parameter(start.clone())
    sync = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    for round_ in range(3):
        delta = 0.02 * torch.randn(64, generator=generator)
        applied = replica.num_applied
        for author in SWARM[:learners]:
            update = make_update(
                author, delta=delta.tolist(), seq=round_, base_applied=applied,
                published_applied=applied, tokens=1000, learners=learners,
            )  # fmt: skip
            result = pipeline.submit(update)
            assert result.accepted and result.weight == 1.0 and result.learners == learners
        reference.grad = delta.clone()  # the mean of M equal pseudo-gradients
        sync.step()
        assert torch.allclose(replica.params, reference.detach(), rtol=1e-5, atol=1e-6)


def test_a_version_1_update_counts_as_one_learner() -> None:
    pipeline = make_pipeline()
    update = make_update()
    sha = hashlib.sha256(update.payload).hexdigest()
    v1 = dataclasses.replace(update.header, learners=None, payload_blake3=None, payload_sha256=sha)
    old = SignedUpdate(v1, ALICE.sign(v1.canonical_bytes()), update.payload)

    result = pipeline.submit(old)

    assert result.accepted and result.learners == 1
    assert pipeline.replica.params.tolist() == [0.90625, 2.0, 3.09375, 3.8125]


def test_claiming_more_learners_only_shrinks_an_update() -> None:
    few, many = make_pipeline(), make_pipeline()
    assert few.submit(make_update(learners=1)).accepted
    assert many.submit(make_update(learners=1024)).accepted

    start = torch.tensor(START)
    moved_few = float(torch.linalg.vector_norm(few.replica.params - start))
    moved_many = float(torch.linalg.vector_norm(many.replica.params - start))
    assert moved_many < moved_few / 100


def test_correction_applies_only_to_conflicting_stale_updates() -> None:
    lenient = RobustConfig(min_cosine=-1.0)  # an update against the momentum is not refused here
    config = dataclasses.replace(
        CONFIG,
        outer=OuterConfig(kind="nesterov", lr=0.5, momentum=0.5),
        correction=CorrectionConfig(kind="heloco", block=2),
        robust=lenient,
    )
    corrected, plain = (
        make_pipeline(config),
        make_pipeline(dataclasses.replace(CONFIG, robust=lenient)),
    )
    for pipeline in (corrected, plain):  # builds momentum along DELTA
        assert pipeline.submit(make_update(seq=0)).accepted
    opposite = [-x for x in DELTA]

    result = corrected.submit(make_update(seq=1, delta=opposite))
    reference = plain.submit(make_update(seq=1, delta=opposite))

    assert result.accepted and result.blocks_corrected == 2
    assert reference.blocks_corrected == 0
    # the conflicting update is cut along the momentum, so it undoes less of the first one
    start = torch.tensor(START)
    kept = float(torch.linalg.vector_norm(corrected.replica.params - start))
    undone = float(torch.linalg.vector_norm(plain.replica.params - start))
    assert kept > undone
