"""The topk codec: chunked top-k, Elias-Fano indices, 2-bit values, with error feedback."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.wire import dp_bytes_per_step, swarm_bytes_per_step, wire_bytes
from merge.codec_base import CodecError
from merge.codecs import get_codec
from merge.feedback import Compressor
from merge.topk import CHUNK, TopKCodec

FAST = settings(max_examples=30, deadline=None)


def distinct_magnitudes(numel: int, seed: int) -> torch.Tensor:
    """A vector whose magnitudes are all different, so its top-k is unique."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.randperm(numel, generator=generator).float() + 1
    signs = torch.randint(0, 2, (numel,), generator=generator).float() * 2 - 1
    return magnitudes * signs


def test_a_chunk_costs_its_levels_indices_and_codes_and_nothing_else() -> None:
    codec = TopKCodec()  # k = 384: 3 low bits, a high bitvector of 384 + 512 bits
    assert codec.payload_bytes(1) == codec.payload_bytes(CHUNK) == 8 + 384 * 3 // 8 + 112 + 96
    assert codec.payload_bytes(10 * CHUNK + 1) == 11 * 360
    assert codec.payload_bytes(0) == 0
    assert 360 / CHUNK < 0.09  # bytes per element, indices and scales included


def test_it_is_over_1000x_below_data_parallel_at_8_learners_and_h_100() -> None:
    numel = 10_844_160  # bench.wire's `small`
    envelope, announcement = wire_bytes("topk", numel, 100, 8)

    ratio = dp_bytes_per_step(numel, 8) / swarm_bytes_per_step(envelope, announcement, 8, 100)

    assert ratio >= 1000


@FAST
@given(numel=st.integers(CHUNK, 3 * CHUNK + 7), seed=st.integers(0, 2**31 - 1))
def test_it_sends_exactly_the_k_largest_entries_of_each_chunk_with_their_signs(
    numel: int, seed: int
) -> None:
    codec = TopKCodec(k=64)
    values = distinct_magnitudes(numel, seed)

    decoded = codec.decode(codec.encode(values), numel)

    padded = torch.nn.functional.pad(values, (0, -numel % CHUNK)).view(-1, CHUNK)
    top = torch.zeros_like(padded, dtype=torch.bool)
    top.scatter_(1, padded.abs().topk(64, dim=1).indices, True)
    assert torch.equal(decoded != 0, top.view(-1)[:numel])
    assert torch.equal(decoded[decoded != 0].sign(), values[decoded != 0].sign())


def test_kept_entries_decode_to_the_two_levels_of_their_chunk() -> None:
    codec = TopKCodec(k=8)
    values = torch.zeros(CHUNK)
    values[[3, 100, 200, 300]] = torch.tensor([8.0, -6.0, 4.0, -2.0])
    values[[400, 500, 600, 4095]] = torch.tensor([1.0, -1.0, 0.5, -0.5])

    decoded = codec.decode(codec.encode(values), CHUNK)

    # halves' means 5 and 0.75; entries above their midpoint 2.875 take hi = mean(8, 6, 4)
    assert decoded.nonzero().view(-1).tolist() == [3, 100, 200, 300, 400, 500, 600, 4095]
    assert decoded[[3, 100, 200]].tolist() == [6.0, -6.0, 6.0]
    assert decoded[[300, 400, 500, 600, 4095]].tolist() == [-1.0, 1.0, -1.0, 1.0, -1.0]


def test_a_chunk_with_fewer_than_k_nonzero_entries_decodes_exactly() -> None:
    values = torch.zeros(CHUNK)
    values[:120] = torch.tensor([3.0, -3.0] * 60)

    assert torch.equal(get_codec("topk").decode(get_codec("topk").encode(values), CHUNK), values)


@pytest.mark.parametrize("k", [8, 384, 2048])
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_any_sorted_index_set_survives_the_elias_fano_round_trip(k: int, data) -> None:
    codec = TopKCodec(k=k)
    seed = data.draw(st.integers(0, 2**31 - 1))
    chosen = np.random.default_rng(seed).choice(CHUNK, size=k, replace=False)
    indices = np.sort(chosen).astype(np.int64)[None, :]

    low, high = codec._pack_indices(indices)
    unpacked = [np.unpackbits(field, axis=1, bitorder="little") for field in (low, high)]

    assert low.nbytes + high.nbytes == (k * codec.low_bits + codec.high_bits) // 8
    assert np.array_equal(codec._indices(*unpacked), indices)


@FAST
@given(seeds=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5))
def test_error_feedback_keeps_exactly_what_each_payload_did_not_send(seeds: list[int]) -> None:
    codec = get_codec("topk")
    numel = 2 * CHUNK + 100
    compressor = Compressor(codec, numel)

    for seed in seeds:
        pseudo_gradient = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
        target = pseudo_gradient + compressor.residual
        sent = codec.decode(compressor.encode(pseudo_gradient), numel)

        assert torch.equal(compressor.residual, target - sent)


def _one_chunk_payload(k: int = 8) -> tuple[TopKCodec, bytearray]:
    codec = TopKCodec(k=k)
    values = torch.zeros(CHUNK)
    values[torch.arange(k) * 500] = torch.arange(1.0, k + 1)
    return codec, bytearray(codec.encode(values))


def test_a_high_bitvector_with_a_bit_too_many_or_too_few_is_refused() -> None:
    codec, payload = _one_chunk_payload()
    high_start = 8 + 8 * codec.low_bits // 8
    for change in (0xFF, 0x00):
        bad = bytearray(payload)
        bad[high_start] = change if bad[high_start] != change else change ^ 0x10
        with pytest.raises(CodecError, match="exactly 8 bits"):
            codec.decode(bytes(bad), CHUNK)


def _with_indices(
    payload: bytearray, codec: TopKCodec, low: list[int], set_bits: list[int]
) -> bytes:
    """``payload`` (one chunk) with its low fields and high bitvector replaced."""
    low_bits = (np.array(low)[:, None] >> np.arange(codec.low_bits)) & 1
    high = np.zeros(codec.high_bits, np.uint8)
    high[set_bits] = 1
    fields = np.packbits(low_bits.reshape(-1).astype(np.uint8), bitorder="little").tobytes()
    fields += np.packbits(high, bitorder="little").tobytes()
    return bytes(payload[:8] + fields + payload[8 + len(fields) :])


def test_indices_past_the_chunk_or_repeated_are_refused() -> None:
    codec, payload = _one_chunk_payload()  # k = 8: 9 low bits, 16 high bits
    increasing = list(range(8))
    assert (
        codec.decode(_with_indices(payload, codec, increasing, increasing), CHUNK)
        .nonzero()
        .view(-1)
        .tolist()
        == increasing
    )

    past_end = _with_indices(payload, codec, increasing, [*range(7), 15])  # high part 8: 4096+
    repeated = _with_indices(payload, codec, [5] * 8, increasing)  # all index 5

    for bad in (past_end, repeated):
        with pytest.raises(CodecError, match="out of range or not increasing"):
            codec.decode(bad, CHUNK)


def test_a_negative_or_non_finite_level_is_refused() -> None:
    codec, payload = _one_chunk_payload()
    for level in (-1.0, float("nan"), float("inf")):
        bad = bytearray(payload)
        bad[0:4] = np.float32(level).tobytes()
        with pytest.raises(CodecError, match="level"):
            codec.decode(bytes(bad), CHUNK)


def test_k_must_fill_whole_bytes_of_codes() -> None:
    for k in (0, 12, CHUNK + 8):
        with pytest.raises(ValueError, match="multiple of 8"):
            TopKCodec(k=k)


def test_a_learner_started_from_its_residual_sends_its_whole_way_from_the_replica() -> None:
    numel = CHUNK + 10
    compressor = Compressor(get_codec("topk"), numel)
    compressor.encode(torch.randn(numel, generator=torch.Generator().manual_seed(1)))
    base = torch.randn(numel, generator=torch.Generator().manual_seed(2))

    start = compressor.round_start(base)
    local = start - 0.1 * torch.randn(numel, generator=torch.Generator().manual_seed(3))
    sent = get_codec("topk").decode(compressor.encode(start - local), numel)

    assert torch.allclose(sent + compressor.residual, base - local, atol=1e-6)
    assert Compressor(get_codec("bf16"), numel).round_start(base) is base  # no residual
