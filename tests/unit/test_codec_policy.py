"""A node picks its codec from its measured uplink; one swarm may mix codecs."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.wire import make_pipeline, seal_payload
from merge.codec_policy import AUTO_CODECS, pick_codec, round_upload_bytes
from merge.codecs import get_codec
from merge.envelope import SignedUpdate
from merge.feedback import Compressor
from tests.factories import identity

NUMEL = 10_844_160  # the `small` model
MBIT = 1e6 / 8


def test_a_fat_link_sends_bf16_and_a_home_uplink_sends_topk() -> None:
    fat = pick_codec(numel=NUMEL, uplink_bytes_per_s=1000 * MBIT, round_s=60, learners=8)
    home = pick_codec(numel=NUMEL, uplink_bytes_per_s=5 * MBIT, round_s=60, learners=8)

    assert (fat.codec, fat.fits) == ("bf16", True)
    assert (home.codec, home.fits) == ("topk", True)  # 7 x 0.95 MB in 10.7 s of 30


def test_between_them_the_largest_codec_that_fits_is_chosen() -> None:
    int8_upload = round_upload_bytes("int8", NUMEL, 8)  # 7 copies of ~11 MB
    link = int8_upload / 30  # exactly half of a 60 s round

    choice = pick_codec(numel=NUMEL, uplink_bytes_per_s=link, round_s=60, learners=8)

    assert choice.codec == "int8" and choice.upload_s == pytest.approx(30)


def test_a_link_too_thin_for_any_codec_takes_the_smallest_and_says_so() -> None:
    choice = pick_codec(numel=NUMEL, uplink_bytes_per_s=10_000, round_s=60, learners=8)

    assert choice.codec == "topk" and not choice.fits
    assert "does NOT fit" in choice.describe()


@settings(max_examples=60, deadline=None)
@given(
    slow=st.floats(1e3, 1e9),
    factor=st.floats(1.0, 100.0),
    round_s=st.floats(1.0, 3600.0),
    learners=st.integers(1, 64),
)
def test_a_faster_uplink_never_picks_a_smaller_codec(
    slow: float, factor: float, round_s: float, learners: int
) -> None:
    def pick(link: float) -> str:
        return pick_codec(
            numel=NUMEL, uplink_bytes_per_s=link, round_s=round_s, learners=learners
        ).codec

    size = {name: get_codec(name).payload_bytes(NUMEL) for name in AUTO_CODECS}
    assert size[pick(slow * factor)] >= size[pick(slow)]


@pytest.mark.parametrize(
    "bad",
    [
        {"uplink_bytes_per_s": 0.0},
        {"uplink_bytes_per_s": float("nan")},
        {"round_s": -1.0},
        {"share": 0.0},
        {"learners": 0},
        {"candidates": ()},
    ],
)
def test_nonsense_measurements_are_refused_with_a_sentence(bad: dict) -> None:
    args = {"numel": NUMEL, "uplink_bytes_per_s": 1e6, "round_s": 60.0, "learners": 4}
    with pytest.raises(ValueError):
        pick_codec(**{**args, **bad})


def test_one_replica_applies_updates_of_different_codecs_from_one_run() -> None:
    numel, h = 5000, 10
    genesis = torch.randn(numel, generator=torch.Generator().manual_seed(1))
    pipeline = make_pipeline(genesis, h, 64, "bf16")
    pseudo_gradient = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-2
    accepted = []
    for rank, codec in enumerate(["bf16", "topk"]):
        payload = Compressor(get_codec(codec), numel).encode(pseudo_gradient)
        update = seal_payload(
            identity(bytes([rank + 1])), codec, payload, numel,
            seq=0, applied=0, tokens=h * 64, inner_steps=h, learners=2,
        )  # fmt: skip
        result = pipeline.submit(SignedUpdate.from_bytes(update.to_bytes()))
        accepted.append((result.accepted, result.reason))

    assert accepted == [(True, None), (True, None)]
    assert pipeline.replica.snapshot()[1] == 2
