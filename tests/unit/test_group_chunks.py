"""A fixed chunking any receiver verifies by range (merge.group_chunks): every split of the
model is a run of whole chunks, so a member of any group fetches exactly its slice of any
other group's update, and checks it against that update's co-signed shard roots."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import merge.group_chunks as group_chunks
from merge.group_chunks import (
    MAX_CHUNKS,
    MIN_CHUNK,
    MIN_CHUNKS,
    aligned_bounds,
    chunk_digests,
    chunk_root,
    chunk_size,
    chunks_in,
    num_chunks,
    slice_problem,
)
from merge.group_contribution import tensor_digest


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 4 elements, at most 16 of them, at least 2: small tensors reach every case."""
    monkeypatch.setattr(group_chunks, "MIN_CHUNK", 4)
    monkeypatch.setattr(group_chunks, "MAX_CHUNKS", 16)
    monkeypatch.setattr(group_chunks, "MIN_CHUNKS", 2)


@given(numel=st.integers(0, 10**12))
def test_the_chunk_size_is_bounded_both_ways(numel: int) -> None:
    """MIN_CHUNK values a chunk, fewer in a small model (down to one), more in a huge one;
    never more than MAX_CHUNKS chunks, never fewer than min(numel, MIN_CHUNKS)."""
    size, count = chunk_size(numel), num_chunks(numel)
    assert size >= 1 and count <= MAX_CHUNKS and count >= min(numel, MIN_CHUNKS)
    assert size <= MIN_CHUNK or math.ceil(numel / (size - 1)) > MAX_CHUNKS  # the smallest
    if numel >= MIN_CHUNKS * MIN_CHUNK:
        assert size >= MIN_CHUNK


@given(numel=st.integers(0, 3000), shards=st.integers(1, 40))
def test_every_split_is_a_run_of_whole_chunks(numel: int, shards: int) -> None:
    bounds = aligned_bounds(numel, shards)
    assert len(bounds) == shards and bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    size = chunk_size(numel)
    assert all(x % size == 0 or x == numel for bound in bounds for x in bound)
    chunks = [len(chunks_in(numel, s, e)) for s, e in bounds]
    assert max(chunks) - min(chunks) <= 1


def _holder(update: torch.Tensor, shards: int) -> list[tuple[tuple[int, int], tuple[str, ...]]]:
    """What an update's holder serves per shard: its bounds and its chunk digests (the
    reducers co-signed each shard's `chunk_root`)."""
    numel = update.numel()
    return [
        ((s, e), chunk_digests(update[s:e], numel, s)) for s, e in aligned_bounds(numel, shards)
    ]


@pytest.mark.usefixtures("small_chunks")
@given(
    numel=st.integers(0, 200),
    theirs=st.integers(1, 12),
    ours=st.integers(1, 12),
    seed=st.integers(),
)
def test_a_slice_of_any_group_fetches_exactly_itself_and_verifies(
    numel: int, theirs: int, ours: int, seed: int
) -> None:
    """Groups of any two sizes: each member's slice meets the other group's shards in whole
    chunks; it fetches exactly its slice's values (not the shards it cuts, whole), each piece
    checked against its shard's co-signed root."""
    update = torch.randn(numel, generator=torch.Generator().manual_seed(seed % 2**31))
    served = _holder(update, theirs)
    for start, end in aligned_bounds(numel, ours):
        fetched = 0
        for (lo, hi), digests in served:
            a, b = max(lo, start), min(hi, end)
            if a >= b:
                continue
            piece = update[a:b].clone()
            assert slice_problem(numel, (lo, hi), chunk_root(digests), digests, a, piece) is None
            fetched += b - a
        assert fetched == end - start


@pytest.mark.usefixtures("small_chunks")
def test_a_piece_that_is_not_what_was_cosigned_is_refused() -> None:
    update = torch.randn(100)
    (shard, digests), *_ = _holder(update, 3)  # chunks of 7: shard 0 is [0, 35)
    root = chunk_root(digests)
    lo, hi = shard
    assert (lo, hi) == (0, 35) and chunk_size(100) == 7
    good = update[7:21].clone()
    assert slice_problem(100, shard, root, digests, 7, good) is None
    bad = good.clone()
    bad[3] += 1e-3
    assert slice_problem(100, shard, root, digests, 7, bad) == "chunk_mismatch"
    assert slice_problem(100, shard, root, digests, 14, good) == "chunk_mismatch"
    forged = (chunk_digests(bad, 100, 7)[0], *digests[1:])
    assert slice_problem(100, shard, root, forged, 7, bad) == "chunk_root_mismatch"
    assert slice_problem(100, shard, root, digests, 8, update[8:22]) == "slice_out_of_shard"
    assert slice_problem(100, shard, root, digests, 28, update[28:42]) == "slice_out_of_shard"
    assert slice_problem(100, shard, root, digests, 7, update[7:20]) == "slice_out_of_shard"
    assert slice_problem(100, shard, root, digests, 7, good.double()) == "slice_shape"


def test_at_the_default_sizes_a_digest_costs_under_one_percent() -> None:
    """A chunk's digest (32 bytes) against its values (4 bytes each), at any model size from
    MIN_CHUNKS x MIN_CHUNK values (the `tiny` model's 445,952: chunks of 1024)."""
    for numel in (MIN_CHUNKS * MIN_CHUNK, 445_952, 10**6, 10**8, 10**10, 10**12):
        assert 32 / (4 * chunk_size(numel)) < 0.008
    assert chunk_size(445_952) == MIN_CHUNK


@given(numel=st.integers(0, 5000), shards=st.integers(1, MIN_CHUNKS))
def test_a_shard_is_empty_only_in_a_model_smaller_than_its_split(numel: int, shards: int) -> None:
    """At least min(numel, MIN_CHUNKS) chunks: no shard of a split into at most MIN_CHUNKS
    is empty unless the model holds fewer values than shards (then as tensor_split cuts)."""
    sizes = [b - a for a, b in aligned_bounds(numel, shards)]
    assert (min(sizes) == 0) == (numel < shards)


@given(numel=st.integers(0, 5000), seed=st.integers(0, 2**31 - 1))
def test_a_chunk_digest_is_the_tensor_digest_of_its_values(numel: int, seed: int) -> None:
    """What a chunk digest is: `tensor_digest` of the chunk (chunk_digests hashes the
    piece's bytes once, chunk by chunk, for speed)."""
    values = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    size = chunk_size(numel)
    expected = tuple(tensor_digest(values[i : i + size]) for i in range(0, numel, size))
    assert chunk_digests(values, numel, 0) == expected
