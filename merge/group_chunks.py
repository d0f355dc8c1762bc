"""The chunk grid every split of a group update is cut on (docs/scale.md, Session 27: the
chunk grid wired; designed in session 16). Pure: no network, no clock.

A group update's shards were once split by its own group's member count, so a member of
another group, whose slice of the model is split by *its* group's count, cut two of them and
fetched both whole to check them against their co-signed digests (up to twice its slice).
Here the model is cut into chunks whose size depends on its length alone (`chunk_size`),
every split (`aligned_bounds`: a part's pieces, a group update's shards, a fetch round
member's slice) is a run of whole chunks, and a shard's digest (what a part's header signs
the root of, what a reducer co-signs, what `GroupUpdate.problem` checks) is the root of its
chunks' digests (`shard_digest`). A member fetches exactly its slice of any group's update,
with the chunk digest list of each shard it lies in, and checks each piece against that
shard's co-signed root (`slice_problem`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence

import torch

MIN_CHUNK = 1024
"""Elements a chunk holds once the model has MIN_CHUNKS x MIN_CHUNK values (4 KiB of fp32):
a chunk's digest (32 bytes) then costs <= 0.8 % of its values."""
MIN_CHUNKS = 256
"""Fewest chunks a model of at least MIN_CHUNKS values is cut into: no shard of a split into
at most this many is empty (group sizes are ~8-32; a smaller model takes chunks of fewer
values, down to one)."""
MAX_CHUNKS = 1 << 14
"""Most chunks a model is cut into: a shard's digest list stays small at any model size."""
_CHUNK_ROOT_TAG = b"diloco-group-chunk-root-v1\x00"


def chunk_size(numel: int) -> int:
    """Elements per chunk of a flat update of `numel` values (the last chunk may be shorter):
    a function of `numel` alone, so every group cuts every update alike. MIN_CHUNK, fewer
    for a model under MIN_CHUNKS x MIN_CHUNK values (at least MIN_CHUNKS chunks, or one per
    value), more past MAX_CHUNKS x MIN_CHUNK (at most MAX_CHUNKS chunks)."""
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}.")
    small = min(MIN_CHUNK, max(1, numel // MIN_CHUNKS))
    return max(small, math.ceil(numel / MAX_CHUNKS))


def num_chunks(numel: int) -> int:
    return math.ceil(numel / chunk_size(numel))


def shard_bounds(numel: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) of each of `num_shards` even runs of `numel` items, as
    `torch.tensor_split(x, num_shards)` cuts them (the first `numel % num_shards` one longer)."""
    if numel < 0 or num_shards < 1:
        raise ValueError(f"numel must be >= 0 and num_shards >= 1, got {numel}, {num_shards}.")
    size, extra = divmod(numel, num_shards)
    bounds, start = [], 0
    for j in range(num_shards):
        end = start + size + (1 if j < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def aligned_bounds(numel: int, num_shards: int) -> list[tuple[int, int]]:
    """[start, end) of each of `num_shards` shards, each a run of whole chunks (the chunks
    split as `shard_bounds` splits items: the first ones one chunk longer). Shards differ
    by at most one chunk. A model has at least min(numel, MIN_CHUNKS) chunks, so a shard
    is empty only when the model holds fewer values than shards or the split is into more
    than MIN_CHUNKS shards (an empty shard's digest is `chunk_root` of no digests)."""
    size = chunk_size(numel)
    return [
        (min(a * size, numel), min(b * size, numel))
        for a, b in shard_bounds(num_chunks(numel), num_shards)
    ]


def split(tensor: torch.Tensor, num_shards: int) -> list[torch.Tensor]:
    """The shards (views) of a flat tensor on the chunk grid (`aligned_bounds`)."""
    return [tensor[a:b] for a, b in aligned_bounds(tensor.numel(), num_shards)]


def chunks_in(numel: int, start: int, end: int) -> range:
    """The chunks that hold any of [start, end): exactly those it is made of when both ends
    are chunk boundaries (as every `aligned_bounds` slice's are)."""
    size = chunk_size(numel)
    if not 0 <= start <= end <= numel:
        raise ValueError(f"[{start}, {end}) is not a range of {numel} values.")
    return range(start // size, math.ceil(end / size)) if end > start else range(0)


def on_grid(numel: int, at: int) -> bool:
    """Whether `at` is a chunk boundary of a flat update of `numel` values."""
    return 0 <= at <= numel and (at % chunk_size(numel) == 0 or at == numel)


def chunk_digests(piece: torch.Tensor, numel: int, start: int) -> tuple[str, ...]:
    """The digests (`tensor_digest`: SHA-256 of the fp32 little-endian bytes) of the chunks
    of `piece`, the values [start, start + len) of a flat update of `numel` values; `start`
    a chunk boundary."""
    size = chunk_size(numel)
    if not on_grid(numel, start) or start + piece.numel() > numel:
        raise ValueError("a piece starts at a chunk boundary, inside the update.")
    data = memoryview(_le_bytes(piece))  # one copy: each chunk hashed from a view of it
    step = 4 * size
    return tuple(hashlib.sha256(data[i : i + step]).hexdigest() for i in range(0, len(data), step))


def _le_bytes(piece: torch.Tensor) -> bytes:
    """The fp32 little-endian bytes `tensor_digest` hashes, of a whole piece at once."""
    flat = piece.detach().to(torch.float32).contiguous().reshape(-1)
    return flat.numpy().astype("<f4", copy=False).tobytes()


def chunk_root(digests: Sequence[str]) -> str:
    """The SHA-256 of a shard's chunks' digests in order (their count included)."""
    return hashlib.sha256(_CHUNK_ROOT_TAG + json.dumps(list(digests)).encode()).hexdigest()


def shard_digest(piece: torch.Tensor, numel: int, start: int) -> str:
    """A shard's digest: the root of its chunks' digests (`chunk_root`); the shard the
    values [start, start + len) of a flat update of `numel` values, `start` on the grid."""
    return chunk_root(chunk_digests(piece, numel, start))


def shard_digests(tensor: torch.Tensor, num_shards: int) -> tuple[str, ...]:
    """Each `aligned_bounds` shard's digest (`shard_digest`) of a flat tensor."""
    numel = tensor.numel()
    return tuple(shard_digest(tensor[a:b], numel, a) for a, b in aligned_bounds(numel, num_shards))


def overlaps(bounds: Sequence[tuple[int, int]], start: int, end: int) -> list[tuple[int, int, int]]:
    """(shard, a, b): each shard of `bounds` that holds any of [start, end), with [a, b)
    what it holds of it, in order. On the chunk grid (`aligned_bounds` splits, an aligned
    slice) every [a, b) is a run of whole chunks."""
    out = []
    for k, (lo, hi) in enumerate(bounds):
        a, b = max(lo, start), min(hi, end)
        if a < b:
            out.append((k, a, b))
    return out


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
    if not all(on_grid(numel, x) for x in (lo, start, end)):
        return "slice_out_of_shard"  # off the chunk grid
    if chunk_root(digests) != root or len(digests) != len(chunks_in(numel, lo, hi)):
        return "chunk_root_mismatch"
    first = (start - lo) // size
    fetched = chunk_digests(piece, numel, start)
    if tuple(digests[first : first + len(fetched)]) != fetched:
        return "chunk_mismatch"
    return None
