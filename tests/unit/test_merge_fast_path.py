"""The merge path reads a received update without copying it: views, not copies, where safe."""

import numpy as np
import torch

from merge.codecs import get_codec
from merge.envelope import SignedUpdate, verify
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.weighting import TokenWeightConfig
from tests.factories import ALICE, FINGERPRINT, sealed_update


def make_update(values: list[float], codec: str = "fp32") -> SignedUpdate:
    return sealed_update(
        ALICE, delta=values, codec=codec, fingerprint=FINGERPRINT, inner_steps=1, tokens=10,
        loss=1.0, created_at=None,
    )  # fmt: skip


def make_pipeline(numel: int) -> UpdatePipeline:
    config = MergeConfig(
        outer=OuterConfig(kind="nesterov", lr=1.0, momentum=0.0),
        token_weight=TokenWeightConfig(kind="none", reference_tokens=10),
        max_inner_steps=1,
        max_tokens_per_step=10,
        max_update_norm_ratio=1e30,
    )
    params = torch.full((numel,), 1e20)
    return UpdatePipeline(
        Replica(params, make_outer_optimizer(config.outer, numel)), config, FINGERPRINT
    )


def test_parsing_immutable_bytes_views_the_payload_and_mutable_ones_copy_it() -> None:
    wire = make_update([1.0, 2.0]).to_bytes()
    mutable = bytearray(wire)

    from_bytes = SignedUpdate.from_bytes(wire)
    from_bytearray = SignedUpdate.from_bytes(mutable)
    mutable[-1] ^= 0xFF  # the sender's buffer changes after parsing

    assert isinstance(from_bytes.payload, memoryview) and from_bytes.payload.obj is wire
    assert from_bytearray.payload == from_bytes.payload
    assert from_bytes.to_bytes() == wire
    verify(from_bytes)
    verify(from_bytearray)


def test_fp32_decode_view_reads_the_payload_in_place() -> None:
    payload = memoryview(np.arange(5, dtype="<f4").tobytes())[4:]

    view = get_codec("fp32").decode_view(payload, 4)

    assert view.tolist() == [1.0, 2.0, 3.0, 4.0]
    assert view.data_ptr() == np.frombuffer(payload, np.uint8).ctypes.data


def test_update_applied_from_a_view_equals_one_applied_from_a_copy() -> None:
    wire = make_update([0.5, -0.25, 2.0]).to_bytes()
    from_view, from_copy = make_pipeline(3), make_pipeline(3)

    assert from_view.submit(SignedUpdate.from_bytes(wire)).accepted
    assert from_copy.submit(SignedUpdate.from_bytes(bytearray(wire))).accepted

    assert torch.equal(from_view.replica.params, from_copy.replica.params)


def test_finite_values_whose_norm_overflows_are_too_large_not_non_finite() -> None:
    pipeline = make_pipeline(2)

    huge = pipeline.submit(make_update([3e38, 3e38]))
    nan = pipeline.submit(make_update([1.0, float("nan")]))

    assert (huge.reason, nan.reason) == ("norm_too_large", "non_finite")
