import pytest
import torch

from merge.codecs import CODECS, CodecError, get_codec


def spread_values(numel: int) -> torch.Tensor:
    """Normal fp32 values of both signs over many orders of magnitude."""
    generator = torch.Generator().manual_seed(0)
    magnitudes = 10.0 ** torch.empty(numel).uniform_(-30, 30, generator=generator)
    return magnitudes * torch.randn(numel, generator=generator).sign()


def test_fp32_round_trip_is_bit_exact_including_specials() -> None:
    values = torch.cat([spread_values(1000), torch.tensor([0.0, -0.0, float("inf"), float("nan")])])
    codec = get_codec("fp32")

    decoded = codec.decode(codec.encode(values), values.numel())

    assert torch.equal(decoded.view(torch.int32), values.view(torch.int32))


def test_bf16_round_trip_stays_within_its_stated_bound() -> None:
    values = spread_values(100_000)
    codec = get_codec("bf16")

    decoded = codec.decode(codec.encode(values), values.numel())

    relative_error = ((decoded - values).abs() / values.abs()).max().item()
    assert relative_error <= codec.max_relative_error == 2**-8
    assert relative_error > 2**-9  # it does round


def test_bf16_rounds_to_nearest_even() -> None:
    codec = get_codec("bf16")
    values = torch.tensor([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -2.5])

    decoded = codec.decode(codec.encode(values), 5)

    assert decoded.tolist() == [1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -2.5]


def test_encodings_are_little_endian() -> None:
    one = torch.tensor([1.0])

    assert get_codec("fp32").encode(one) == b"\x00\x00\x80\x3f"
    assert get_codec("bf16").encode(one) == b"\x80\x3f"


@pytest.mark.parametrize("name", sorted(CODECS))
def test_decode_returns_a_fresh_writable_fp32_vector(name: str) -> None:
    codec = get_codec(name)
    values = torch.zeros(4096)
    values[: 120 * 32 : 32] = 2.0  # sparse keeps 120: equal magnitudes, exact in every codec
    values[: 120 * 32 : 64] = -2.0
    data = codec.encode(values)

    first = codec.decode(data, values.numel())
    first += 100
    second = codec.decode(data, values.numel())

    assert second.dtype == torch.float32 and second.shape == values.shape
    assert torch.equal(second, values)
    assert len(data) == codec.payload_bytes(values.numel())


@pytest.mark.parametrize("name", sorted(CODECS))
def test_decode_with_the_wrong_length_is_a_codec_error(name: str) -> None:
    codec = get_codec(name)
    data = codec.encode(torch.ones(10))

    for numel in (-1, 10_000, 2**40, 2**41, 10.0, True):
        with pytest.raises(CodecError):
            codec.decode(data, numel)  # type: ignore[arg-type]
    with pytest.raises(CodecError):
        codec.decode(data[:-1], 10)
    with pytest.raises(CodecError):
        codec.decode(data + b"\0", 10)


@pytest.mark.parametrize(
    "bad", [torch.ones(2, 2), torch.ones(3, dtype=torch.float64), torch.ones(3, dtype=torch.int32)]
)
def test_encode_accepts_only_flat_fp32(bad: torch.Tensor) -> None:
    for codec in CODECS.values():
        with pytest.raises(CodecError):
            codec.encode(bad)


def test_unknown_codec_names_the_known_ones() -> None:
    known = "fp32, bf16, int8, int4, sparse"
    with pytest.raises(CodecError, match=f"unknown codec 'int3'; known: {known}"):
        get_codec("int3")


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_decode_and_decode_view_agree_on_the_tail_of_an_odd_length_vector(name: str) -> None:
    # Speed is bench.merge_speed's figure (codec rows), not a timed test: a loaded machine
    # fails any wall-clock bound. This checks the vectorised paths, whose tails differ.
    codec = get_codec(name)
    values = spread_values(100_003)
    payload = codec.encode(values)

    decoded, viewed = codec.decode(payload, values.numel()), codec.decode_view(payload, 100_003)

    assert torch.equal(decoded, viewed)
    expected = values.to(torch.bfloat16).float() if name == "bf16" else values
    assert torch.equal(decoded[-7:], expected[-7:])


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_codecs_decode_a_constant_vector_exactly_to_its_padded_end(name: str) -> None:
    codec = get_codec(name)
    values = torch.full((100_003,), 0.5)  # the last block is padded

    decoded = codec.decode(codec.encode(values), values.numel())

    assert torch.equal(decoded, values)


def test_sparse_keeps_k_entries_of_every_chunk_including_the_padded_last() -> None:
    codec = get_codec("sparse")
    values = torch.full((100_003,), 0.5)  # 25 chunks of 4096, the last one padded

    decoded = codec.decode(codec.encode(values), values.numel())

    assert int((decoded == 0.5).sum()) == 25 * codec.k  # type: ignore[attr-defined]
    assert int((decoded != 0).sum()) == 25 * codec.k  # type: ignore[attr-defined]
