"""A fixed chunking of a flat update that any receiver verifies by range (docs/scale.md,
Session 16: aligned slices by chunk digests). Pure; not wired yet.

A group update's shards are split by its own group's member list, so a member of another
group, whose slice of the model is split by *its* group's list, cuts two of them and must
fetch both whole to check them against their co-signed digests (up to twice its slice). Here
the model is cut into chunks whose size depends on its length alone (`chunk_size`: at least
MIN_CHUNK elements, at most MAX_CHUNKS chunks), every split (`aligned_bounds`) is a run of
whole chunks, and a shard's digest is the root of its chunks' digests (`chunk_root`). Then
every member's slice of every group's update is a run of whole chunks, and a member fetches
exactly its chunks, with the digest list of each shard they lie in, and checks them against
that shard's co-signed root (`slice_problem`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

import torch

from merge.group_plan import shard_bounds
from merge.group_update import tensor_digest

MIN_CHUNK = 1024
"""Fewest elements a chunk holds (4 KiB of fp32): a digest (32 bytes) costs <= 0.8 %."""
MAX_CHUNKS = 1 << 14
"""Most chunks a model is cut into: a shard's digest list stays small at any model size."""
_CHUNK_ROOT_TAG = b"diloco-group-chunk-root-v1\x00"


def chunk_size(numel: int) -> int:
    """Elements per chunk of a flat update of `numel` values (the last chunk may be shorter):
    a function of `numel` alone, so every group cuts every update alike."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}.")
    return max(MIN_CHUNK, math.ceil(numel / MAX_CHUNKS))


def num_chunks(numel: int) -> int:
    return math.ceil(numel / chunk_size(numel))


def aligned_bounds(numel: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) of each of `num_shards` shards, each a run of whole chunks (the chunks
    split as `shard_bounds` splits elements: the first ones one chunk longer). Shards differ
    by at most one chunk; with fewer chunks than shards the last shards are empty."""
    size = chunk_size(numel)
    return [
        (min(a * size, numel), min(b * size, numel))
        for a, b in shard_bounds(num_chunks(numel), num_shards)
    ]


def chunks_in(numel: int, start: int, end: int) -> range:
    """The chunks that hold any of [start, end): exactly those it is made of when both ends
    are chunk boundaries (as every `aligned_bounds` slice's are)."""
    size = chunk_size(numel)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"[{start}, {end}) is not a range of {numel} values.")
    return range(start // size, math.ceil(end / size)) if end > start else range(0)


def chunk_digests(piece: torch.Tensor, numel: int, start: int) -> tuple[str, ...]:
    """The digests (`tensor_digest`) of the chunks of `piece`, the values [start, start +
    len) of a flat update of `numel` values; `start` a chunk boundary."""
    size = chunk_size(numel)
    if (start % size and start != numel) or start + piece.numel() > numel:
        raise ValueError("a piece starts at a chunk boundary, inside the update.")
    return tuple(tensor_digest(piece[i : i + size]) for i in range(0, piece.numel(), size))


def chunk_root(digests: Sequence[str]) -> str:
    """What a shard's reducer co-signs as its shard's digest: the SHA-256 of its chunks'
    digests in order (their count included)."""
    return hashlib.sha256(_CHUNK_ROOT_TAG + json.dumps(list(digests)).encode()).hexdigest()


def slice_problem(
    numel: int,
    shard: tuple[int, int],
    root: str,
    digests: Sequence[str],
    start: int,
    piece: torch.Tensor,
) -> str | None:
    """Why `piece`, claimed to be the values [start, start + len) of a flat update of `numel`
    values, is not what the reducer of the shard at `shard` ([start, end), an
    `aligned_bounds` shard) co-signed as `root`, or None. `digests`: the shard's chunk
    digests, as its holder serves them with the piece. The piece must lie in the shard, on
    chunk boundaries, and each of its chunks must match its digest."""
    lo, hi = shard
    size = chunk_size(numel)
    end = start + piece.numel()
    if piece.dim() != 1 or piece.dtype != torch.float32:
        return "slice_shape"
    if not 0 <= lo <= start <= end <= hi <= numel:
        return "slice_out_of_shard"
    if any(x % size and x != numel for x in (lo, start, end)):
        return "slice_out_of_shard"  # off the chunk grid
    if chunk_root(digests) != root or len(digests) != len(chunks_in(numel, lo, hi)):
        return "chunk_root_mismatch"
    first = (start - lo) // size
    fetched = chunk_digests(piece, numel, start)
    if tuple(digests[first : first + len(fetched)]) != fetched:
        return "chunk_mismatch"
    return None
