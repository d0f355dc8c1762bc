"""Balanced greedy bin-packing of tensors into fragments, and their staggered publication."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.fragments import partition, publish_steps


@settings(max_examples=60, deadline=None)
@given(data=st.data(), sizes=st.lists(st.integers(0, 10**7), min_size=1, max_size=60))
def test_every_tensor_lands_in_one_fragment_and_loads_stay_balanced(
    data: st.DataObject, sizes: list[int]
) -> None:
    num_fragments = data.draw(st.integers(1, len(sizes)))

    fragments = partition(sizes, num_fragments)

    assert sorted(i for f in fragments for i in f) == list(range(len(sizes)))
    assert len(fragments) <= num_fragments
    loads = [sum(sizes[i] for i in f) for f in fragments]
    assert max(loads) <= sum(sizes) / num_fragments + max(sizes)


def test_a_small_model_splits_into_near_equal_fragments() -> None:
    sizes = [98_304] + [147_456, 589_824, 589_824, 384] * 6  # embeddings, then 6 blocks

    loads = [sum(sizes[i] for i in f) for f in partition(sizes, 4)]

    assert len(loads) == 4 and max(loads) / min(loads) < 1.1


def test_publication_is_staggered_evenly_over_the_round() -> None:
    assert publish_steps(1, 100) == [100]
    assert publish_steps(4, 100) == [25, 50, 75, 100]
    with pytest.raises(ValueError):
        publish_steps(0, 100)
    with pytest.raises(ValueError):
        partition([1, 2], 3)
