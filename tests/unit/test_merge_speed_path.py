"""The merge path's shortcuts (issue 9.3) change how fast, never what, a replica computes.

- the params-norm pass is skipped while bounds carried through the steps settle the
  norm_too_large verdict: the verdicts are those of the exact norm;
- bf16 decodes into a buffer reused across updates: the params are those of fresh decodes;
- BLAKE3 hashes a large payload on several threads: the same digest, the same verdict.
"""

import hashlib
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.codecs import CodecError, get_codec
from merge.envelope import PARALLEL_HASH_MIN_BYTES, SignedUpdate, payload_matches
from merge.outer import DelayedNesterov, NesterovSGD, OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.weighting import TokenWeightConfig
from tests.factories import identity, sealed_update

FINGERPRINT = hashlib.sha256(b"speed").hexdigest()
AUTHORS = [identity(bytes([65 + i])) for i in range(3)]
NUMEL = 64


def make_pipeline(ratio: float = 1.0, numel: int = NUMEL) -> UpdatePipeline:
    config = MergeConfig(
        outer=OuterConfig(lr=0.7, momentum=0.9),
        token_weight=TokenWeightConfig(kind="none", reference_tokens=1),
        max_inner_steps=1,
        max_tokens_per_step=1,
        max_update_norm_ratio=ratio,
    )
    params = torch.linspace(-1.0, 1.0, numel)
    return UpdatePipeline(
        Replica(params, make_outer_optimizer(config.outer, numel)), config, FINGERPRINT
    )


def make_update(
    delta: torch.Tensor, seq: int, author: int = 0, codec: str = "fp32", learners: int = 4
) -> SignedUpdate:
    update = sealed_update(
        AUTHORS[author], delta=delta, codec=codec, fingerprint=FINGERPRINT, seq=seq,
        inner_steps=1, tokens=1, loss=1.0, learners=learners,
    )  # fmt: skip
    return SignedUpdate.from_bytes(update.to_bytes())  # as received: a view into the bytes


def exact_verdict(pipeline: UpdatePipeline, update: SignedUpdate) -> bool:
    """Whether the update is too large by the exact norms, computed as the path did before."""
    decoded = get_codec(update.header.codec).decode(update.payload, update.header.numel)
    update_norm = float(torch.linalg.vector_norm(decoded))
    params_norm = float(torch.linalg.vector_norm(pipeline.replica.params))
    return update_norm > pipeline.config.max_update_norm_ratio * max(params_norm, 1e-12)


@settings(max_examples=10, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.01, 1.3),  # the update's norm relative to the params', near the limit
            st.integers(1, 4),  # learners
            st.integers(0, 2**16),  # direction seed
        ),
        min_size=1,
        max_size=12,
    ),
    st.sampled_from([0.25, 1.0]),
)
def test_norm_verdicts_are_those_of_the_exact_params_norm(
    steps: list[tuple[float, int, int]], ratio: float
) -> None:
    pipeline = make_pipeline(ratio)
    for seq, (relative, learners, seed) in enumerate(steps):
        direction = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))
        params_norm = float(torch.linalg.vector_norm(pipeline.replica.params))
        delta = direction / direction.norm() * relative * ratio * params_norm
        update = make_update(delta, seq, learners=learners)
        too_large = exact_verdict(pipeline, update)

        result = pipeline.submit(update)

        assert (result.reason == "norm_too_large") == too_large
        assert result.accepted == (not too_large)


@settings(max_examples=20, deadline=None)
@given(
    st.lists(
        st.tuples(st.floats(0.0, 2.0), st.integers(1, 8), st.floats(1e-3, 10.0)),
        min_size=1,
        max_size=30,
    )
)
def test_params_norm_bounds_hold_the_norm_torch_computes(
    steps: list[tuple[float, int, float]],
) -> None:
    replica = Replica(
        torch.linspace(-3.0, 5.0, 257), DelayedNesterov(lr=0.7, momentum=0.9, numel=257)
    )
    replica.params_norm()
    generator = torch.Generator().manual_seed(0)
    for seq, (weight, learners, scale) in enumerate(steps):
        g = torch.randn(257, generator=generator) * scale
        header = make_update(g, seq, learners=learners).header

        replica.apply(header, g, weight, float(torch.linalg.vector_norm(g)))

        bounds = replica.params_norm_bounds()
        norm = float(torch.linalg.vector_norm(replica.params))
        if bounds is not None:
            assert bounds[0] <= norm <= bounds[1]
        else:
            assert replica.params_norm() == norm  # a round's fold: the next update reads them


def test_bounds_skip_the_params_pass_mid_round_and_not_after_a_fold() -> None:
    pipeline = make_pipeline()
    replica = pipeline.replica
    passes = []
    exact = replica.params_norm
    replica.params_norm = lambda: passes.append(1) or exact()  # type: ignore[method-assign,func-returns-value]
    small = torch.full((NUMEL,), 1e-3)

    for seq in range(5):  # learners 4: the 4th update folds the momentum in
        assert pipeline.submit(make_update(small, seq)).accepted

    assert len(passes) == 2  # the first update, and the one after the fold


@pytest.mark.parametrize(
    "change",
    [
        lambda r: r.params.add_(1.0),
        lambda r: r.load_state_dict(r.state_dict()),
        lambda r: r.apply(make_update(torch.ones(NUMEL), 9).header, torch.ones(NUMEL), 1.0),
    ],
    ids=["in-place write", "state load", "apply without a norm"],
)
def test_any_other_change_to_the_params_drops_the_bounds(change: Any) -> None:
    replica = make_pipeline().replica
    replica.params_norm()
    assert replica.params_norm_bounds() is not None

    change(replica)

    assert replica.params_norm_bounds() is None


def test_outer_steps_report_how_far_they_moved_the_params_along_the_update() -> None:
    delayed = DelayedNesterov(lr=0.5, momentum=0.9, numel=3)
    params, g = torch.zeros(3), torch.tensor([1.0, -2.0, 4.0])

    mid_round = delayed.step(params, g, 0.5, learners=2)
    assert mid_round == 0.5 * 0.5 / 2 and torch.equal(params, -mid_round * g)
    assert delayed.step(params, g, 0.5, learners=2) is None  # the fold adds momentum
    assert NesterovSGD(lr=0.5, momentum=0.9, numel=3).step(torch.zeros(3), g, 1.0) is None


@settings(max_examples=20, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True), min_size=1, max_size=50))
def test_bf16_decode_into_equals_decode(values: list[float]) -> None:
    codec = get_codec("bf16")
    payload = codec.encode(torch.tensor(values, dtype=torch.float32))
    out = torch.full((len(values) + 3,), 7.0)

    decoded = codec.decode_into(payload, len(values), out[: len(values)])  # type: ignore[attr-defined]

    assert decoded.data_ptr() == out.data_ptr()
    fresh = codec.decode(payload, len(values))
    assert np.array_equal(decoded.numpy().view(np.uint32), fresh.numpy().view(np.uint32))
    assert out[len(values) :].tolist() == [7.0] * 3


def test_bf16_decode_into_refuses_bad_input_before_writing() -> None:
    codec = get_codec("bf16")
    out = torch.zeros(4)

    with pytest.raises(CodecError):
        codec.decode_into(b"\x00\x01" * 3, 4, out)  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        codec.decode_into(b"\x00\x01" * 4, 4, torch.zeros(4, dtype=torch.float64))  # type: ignore[attr-defined]
    assert out.tolist() == [0.0] * 4


@pytest.mark.parametrize("buffer_busy", [False, True])
def test_bf16_updates_through_the_reused_buffer_apply_as_fresh_decodes(buffer_busy: bool) -> None:
    pipeline = make_pipeline()
    reference = make_pipeline().replica
    generator = torch.Generator().manual_seed(3)
    if buffer_busy:  # another submission holds the buffer: this one decodes into its own
        pipeline._scratch_lock.acquire()
    for seq in range(6):
        update = make_update(torch.randn(NUMEL, generator=generator) * 1e-2, seq, codec="bf16")

        assert pipeline.submit(update).accepted

        decoded = get_codec("bf16").decode(update.payload, NUMEL)
        reference.apply(update.header, decoded, pipeline.weight_of(update.header))
        assert torch.equal(pipeline.replica.params, reference.params)


def test_a_large_payload_hashed_on_threads_has_the_same_verdicts() -> None:
    payload = np.random.default_rng(0).bytes(PARALLEL_HASH_MIN_BYTES + 4096)
    header = sealed_update(
        AUTHORS[0], payload=payload, fingerprint=FINGERPRINT, inner_steps=1, tokens=1, loss=1.0,
        created_at=None,
    ).header  # fmt: skip
    tampered = bytearray(payload)
    tampered[-1] ^= 1

    assert payload_matches(header, payload, max_threads=2)
    assert payload_matches(header, memoryview(payload), max_threads=4)
    assert not payload_matches(header, bytes(tampered), max_threads=2)
