"""int8, int4 and sparse top-k codecs, and the error feedback that makes them lossless over time."""

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.codec_base import CodecError
from merge.codecs import CODECS, get_codec
from merge.feedback import RESTART_FROM_REPLICA, Compressor
from merge.quantize import Int4Codec, Int8Codec
from merge.sparse import SparseTopKCodec

LOSSY = ["int8", "int4", "sparse", "topk"]
FAST = settings(max_examples=25, deadline=None)


def finite_vectors(max_size: int = 700) -> st.SearchStrategy[torch.Tensor]:
    """fp32 vectors of ordinary magnitudes (no overflow when summed), zeros and ties included."""
    ordinary = st.floats(-(2.0**100), 2.0**100, allow_nan=False, width=32)
    elements = ordinary | st.sampled_from([0.0, 1.0])
    arrays = hnp.arrays(np.float32, st.integers(0, max_size), elements=elements)
    return arrays.map(lambda a: torch.from_numpy(a.copy()))


def test_payload_sizes_are_what_the_wire_budget_promises() -> None:
    numel = 10 * 4096
    assert get_codec("int8").payload_bytes(numel) == numel + 4 * numel // 256
    assert get_codec("int4").payload_bytes(numel) == numel // 2 + 4 * numel // 64
    assert get_codec("sparse").payload_bytes(numel) == 10 * (8 + 2 * 120 + 30)
    assert get_codec("sparse").payload_bytes(numel) / (4 * numel) < 0.02  # > 50x below fp32


@pytest.mark.parametrize("codec", [Int8Codec(), Int4Codec()], ids=["int8", "int4"])
@FAST
@given(values=finite_vectors())
def test_blockwise_error_is_at_most_half_a_step_of_its_block(
    codec: Int8Codec | Int4Codec, values: torch.Tensor
) -> None:
    decoded = codec.decode(codec.encode(values), values.numel())

    padded = torch.nn.functional.pad(values, (0, -values.numel() % codec.block))
    absmax = padded.view(-1, codec.block).abs().amax(dim=1).repeat_interleave(codec.block)
    half_step = absmax[: values.numel()] / (2 * codec.qmax)
    assert bool(((decoded - values).abs() <= half_step * (1 + 2**-20) + 1e-38).all())


@FAST
@given(values=finite_vectors(3 * 4096 + 5))
def test_sparse_keeps_signs_never_adds_error_energy_and_sends_k_per_chunk(
    values: torch.Tensor,
) -> None:
    codec = SparseTopKCodec()

    decoded = codec.decode(codec.encode(values), values.numel())

    kept = decoded != 0
    assert bool((decoded[kept].sign() * values[kept].sign() >= 0).all())
    assert int(kept.sum()) <= codec.k * -(-values.numel() // codec.chunk)
    error = float(torch.linalg.vector_norm((decoded - values).double()))
    assert error <= float(torch.linalg.vector_norm(values.double())) * (1 + 1e-5)


def test_sparse_sends_the_largest_entries_of_each_chunk() -> None:
    codec = SparseTopKCodec(chunk=64, k=8)
    values = torch.zeros(128)
    values[[1, 5, 9, 13, 17, 21, 25, 29]] = torch.tensor([9.0, -9, 9, -9, 1, -1, 1, -1])
    values[30:40] = 0.5  # below the chunk's top 8: dropped
    values[100] = -3.0

    decoded = codec.decode(codec.encode(values), 128)

    assert decoded[:64].nonzero().view(-1).tolist() == [1, 5, 9, 13, 17, 21, 25, 29]
    assert decoded[[1, 5, 17, 21]].tolist() == [9.0, -9.0, 1.0, -1.0]
    assert decoded[100].item() == pytest.approx(-3.0 / 4)  # hi level: mean of |-3|, 0, 0, 0


def test_exactly_the_lossy_codecs_use_error_feedback() -> None:
    assert [name for name, codec in CODECS.items() if codec.error_feedback] == LOSSY


@pytest.mark.parametrize("name", LOSSY)
@FAST
@given(
    numel=st.integers(1, 9000),
    seeds=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=6),
    scale=st.floats(1e-6, 1e3),
)
def test_error_feedback_conserves_mass(
    name: str, numel: int, seeds: list[int], scale: float
) -> None:
    codec = get_codec(name)
    compressor = Compressor(codec, numel)
    put_in = torch.zeros(numel, dtype=torch.float64)
    sent = torch.zeros(numel, dtype=torch.float64)

    for seed in seeds:
        pseudo_gradient = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
        payload = compressor.encode(pseudo_gradient)
        put_in += pseudo_gradient.double()
        sent += codec.decode(payload, numel).double()

    tolerance = 1e-5 * scale * len(seeds)
    assert torch.allclose(sent + compressor.residual.double(), put_in, rtol=0, atol=tolerance)


@pytest.mark.parametrize("name", [c for c in LOSSY if c not in RESTART_FROM_REPLICA])
@FAST
@given(
    numel=st.integers(1, 9000),
    seeds=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=5),
    scale=st.floats(1e-6, 1e3),
)
def test_a_learner_started_from_its_residual_sends_its_whole_way_from_the_replica(
    name: str, numel: int, seeds: list[int], scale: float
) -> None:
    """Each round starts at replica - residual (Compressor.round_start): the round's payload
    plus the residual it leaves is exactly its way from the replica, replica - params, so
    nothing it trained is counted twice and nothing is dropped."""
    codec = get_codec(name)
    compressor = Compressor(codec, numel)

    for seed in seeds:
        noise = torch.randn(2, numel, generator=torch.Generator().manual_seed(seed)) * scale
        replica = noise[0]
        start = compressor.round_start(replica)
        local = start - noise[1]  # where the round's inner steps took the learner
        sent = codec.decode(compressor.encode(start - local), numel)

        assert torch.allclose(
            sent.double() + compressor.residual.double(),
            (replica - local).double(),
            rtol=0,
            atol=1e-5 * scale * (1 + len(seeds)),
        )


def test_a_sparse_learner_restarts_from_the_replica() -> None:
    compressor = Compressor(get_codec("sparse"), 5000)
    compressor.encode(torch.randn(5000, generator=torch.Generator().manual_seed(0)))
    replica = torch.randn(5000)
    assert bool(compressor.residual.any()) and compressor.round_start(replica) is replica


def test_error_feedback_sends_what_one_round_dropped_in_the_next() -> None:
    codec = SparseTopKCodec(chunk=8, k=8)  # keeps all 8; two magnitude levels lose detail
    compressor = Compressor(codec, 8)
    values = torch.tensor([4.0, 3, 2, 1, -1, -2, -3, -4])

    first = codec.decode(compressor.encode(values), 8)
    second = codec.decode(compressor.encode(torch.zeros(8)), 8)

    assert not torch.equal(first, values)
    assert torch.allclose(compressor.residual, values - first - second)
    assert float((values - first - second).norm()) < float((values - first).norm())


def test_a_non_finite_round_resets_the_residual_and_is_not_decodable() -> None:
    codec = get_codec("int8")
    compressor = Compressor(codec, 300)
    compressor.encode(torch.randn(300))
    assert bool(compressor.residual.abs().sum() > 0)

    payload = compressor.encode(torch.full((300,), float("nan")))

    assert bool((compressor.residual == 0).all())
    with pytest.raises(CodecError):
        codec.decode(payload, 300)


def test_compressor_state_round_trips_and_keeps_another_codecs_residual() -> None:
    """What was not sent is progress whichever codec left it (--codec auto may restart
    with another): the next payload carries it, a codec without error feedback whole."""
    compressor = Compressor(get_codec("int4"), 100)
    compressor.encode(torch.randn(100))
    restored = Compressor(get_codec("int4"), 100)

    restored.load_state_dict(compressor.state_dict())
    other = Compressor(get_codec("bf16"), 100)
    other.load_state_dict(compressor.state_dict())
    pseudo_gradient = torch.randn(100)
    payload = other.encode(pseudo_gradient)

    assert torch.equal(restored.residual, compressor.residual)
    expected = (pseudo_gradient + compressor.residual).bfloat16().float()
    assert torch.equal(get_codec("bf16").decode(payload, 100), expected)
    assert not other.pending()
    with pytest.raises(ValueError):
        restored.load_state_dict({"codec": "int4", "residual": torch.zeros(99)})
    with pytest.raises(ValueError):
        restored.load_state_dict({"codec": "int4", "residual": "not a tensor"})


@pytest.mark.parametrize("name", sorted(CODECS))
@settings(max_examples=40, deadline=None)
@given(data=st.binary(max_size=600), numel=st.integers(0, 5000))
def test_arbitrary_bytes_raise_only_codec_errors(name: str, data: bytes, numel: int) -> None:
    codec = get_codec(name)
    try:
        decoded = codec.decode(data, numel)
    except CodecError:
        decoded = None
    # decode_view reads a view into the envelope, as the merge path does: the same verdict
    envelope = b"header" + data
    try:
        viewed = codec.decode_view(memoryview(envelope)[6:], numel)
    except CodecError:
        assert decoded is None
        return
    assert decoded is not None and decoded.shape == (numel,) and decoded.dtype == torch.float32
    assert torch.equal(viewed.view(torch.int32), decoded.view(torch.int32))


@pytest.mark.parametrize("name", sorted(CODECS))
@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 5000),
    flips=st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), min_size=1, max_size=8),
)
def test_mutated_payloads_raise_only_codec_errors_and_decode_finite(
    name: str, numel: int, flips: list[tuple[int, int]]
) -> None:
    codec = get_codec(name)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    payload = bytearray(codec.encode(values))
    for position, value in flips:
        payload[position % len(payload)] = value
    try:
        decoded = codec.decode(bytes(payload), numel)
    except CodecError:
        return
    assert decoded.shape == (numel,)
    if codec.error_feedback:  # fp32 and bf16 carry inf and NaN; the pipeline rejects those
        assert bool(torch.isfinite(decoded).all())


@pytest.mark.parametrize("name", sorted(CODECS))
def test_decoders_refuse_a_huge_claimed_size_before_allocating(name: str) -> None:
    with pytest.raises(CodecError, match="needs"):
        get_codec(name).decode(b"\0" * 64, 2**40)
    with pytest.raises(CodecError, match="needs"):
        get_codec(name).decode_view(memoryview(b"\0" * 64), 2**40)
    with pytest.raises(CodecError, match="integer"):
        get_codec(name).decode(b"", 2**40 + 1)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_decoders_refuse_buffers_that_are_not_flat_bytes(name: str) -> None:
    codec = get_codec(name)
    payload = codec.encode(torch.ones(64))
    words = memoryview(bytearray(payload)).cast("B").cast("H") if len(payload) % 2 == 0 else None
    for bad in (list(payload), payload.decode("latin-1"), words):
        if bad is None:
            continue
        with pytest.raises(CodecError):
            codec.decode(bad, 64)  # type: ignore[arg-type]
        with pytest.raises(CodecError):
            codec.decode_view(bad, 64)  # type: ignore[arg-type]


def test_decoders_name_what_is_wrong() -> None:
    int8 = get_codec("int8")
    payload = bytearray(int8.encode(torch.ones(256)))
    payload[4] = 0x80  # code -128
    with pytest.raises(CodecError, match="-128"):
        int8.decode(bytes(payload), 256)
    payload = bytearray(int8.encode(torch.ones(256)))
    payload[0:4] = np.float32("inf").tobytes()
    with pytest.raises(CodecError, match="scale"):
        int8.decode(bytes(payload), 256)
    sparse = SparseTopKCodec(chunk=16, k=8)
    payload = bytearray(sparse.encode(torch.arange(16.0)))
    payload[8:10] = payload[10:12]  # first index repeats the second
    with pytest.raises(CodecError, match="increasing"):
        sparse.decode(bytes(payload), 16)
