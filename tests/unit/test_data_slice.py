import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.builders import build_run_spec
from node.config import JoinConfig
from node.data import Corpus, data_slice, parse_data_slice


def test_without_a_slice_the_whole_split_is_used() -> None:
    train = np.arange(10, dtype=np.uint16)
    assert data_slice(train, None) is train


@settings(max_examples=60, deadline=None)
@given(length=st.integers(1, 500), n=st.integers(1, 12))
def test_slices_are_disjoint_contiguous_and_equal(length: int, n: int) -> None:
    train = np.arange(length, dtype=np.int64)
    slices = [data_slice(train, f"{k}/{n}") for k in range(n)]

    assert {len(s) for s in slices} == {length // n}
    for k, piece in enumerate(slices):
        assert piece.tolist() == list(range(k * (length // n), (k + 1) * (length // n)))


@pytest.mark.parametrize("spec", ["3/3", "-1/3", "1", "a/b", "1/2/3", "0/0", "0/5000"])
def test_a_bad_slice_is_refused_with_a_one_line_message(spec: str) -> None:
    with pytest.raises(ValueError, match="--data-slice"):
        parse_data_slice(spec)
    with pytest.raises(ValueError, match="--data-slice"):
        JoinConfig(data_slice=spec)


def test_join_accepts_a_slice() -> None:
    assert JoinConfig(data_slice="2/3").data_slice == "2/3"


def test_correction_strength_is_in_the_fingerprint_and_a_data_slice_is_not() -> None:
    corpus = Corpus(np.zeros(4096, dtype=np.uint8), vocab_size=256, source="zeros")

    def fingerprint(**kw: object) -> str:
        return build_run_spec(JoinConfig(correction="heloco", **kw), corpus).fingerprint  # type: ignore[arg-type]

    assert fingerprint(correction_strength=10.0) != fingerprint()
    assert fingerprint(data_slice="0/3") == fingerprint()  # a node's own data, not the run's
