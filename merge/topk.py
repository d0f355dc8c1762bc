"""Chunked top-k with Elias-Fano indices and 2-bit values: the codec for thin links.

Like merge.sparse (SparseLoCo, arXiv 2508.15706), the vector is cut into chunks of 4096
elements (the last one padded with zeros) and each chunk keeps its ``k`` entries of largest
magnitude, each sent as 2 bits: its sign and one of two magnitude levels of its chunk (the
means of the kept magnitudes above and below a threshold: 2-means, see ``_two_levels``).
What it does differently is the indices: a chunk's k sorted indices are Elias-Fano coded,
``L = floor(log2(4096 / k))`` low bits of each in a fixed field and the high parts as a
bitvector of ``k + 4096 / 2**L`` bits (index i of the chunk, high part h, sets bit h + i).
That is about 2 + log2(4096 / k) bits an index, 5.4 at k = 384 instead of 16, and the
size is fixed by k alone, so the payload's length still follows from ``numel``. Twice the
entries of merge.sparse fit the same bytes, and the merge gets a denser, fresher update.

Payload layout (little-endian; bit fields least significant bit first), for ``n`` chunks:
n pairs of fp32 levels (lo, hi; finite, >= 0); n fields of k * L low bits (index i's low
bits at bits iL .. iL + L - 1); n high bitvectors of k + 4096 / 2**L bits, each with
exactly k bits set; n * k / 4 bytes of 2-bit codes as in merge.sparse. A chunk's indices
must be strictly increasing and below 4096.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from merge.codec_base import Buffer, CodecError, check_flat, check_length, num_blocks
from merge.sparse import pack_codes, scatter_chunks, unpack_codes

CHUNK = 4096
"""Elements per chunk."""
_LEVEL_BYTES = 8
_CODES_PER_BYTE = 4


class TopKCodec:
    """Top 384 of every 4096 entries (9.4 %), 7.3 bits each: 0.088 bytes per element."""

    name = "topk"
    error_feedback = True

    def __init__(self, k: int = 384) -> None:
        if not 0 < k <= CHUNK or k % (2 * _CODES_PER_BYTE):
            raise ValueError("topk codec needs 0 < k <= 4096 with k a multiple of 8.")
        self.k = k
        self.low_bits = (CHUNK // k).bit_length() - 1
        self.high_bits = k + (CHUNK >> self.low_bits)

    @property
    def density(self) -> float:
        return self.k / CHUNK

    def payload_bytes(self, numel: int) -> int:
        return num_blocks(numel, CHUNK) * self._chunk_bytes()

    def _chunk_bytes(self) -> int:
        index_bits = self.k * self.low_bits + self.high_bits
        return _LEVEL_BYTES + index_bits // 8 + self.k // _CODES_PER_BYTE

    def encode(self, flat: torch.Tensor) -> bytes:
        check_flat(flat)
        numel = flat.numel()
        chunks = F.pad(flat.detach(), (0, num_blocks(numel, CHUNK) * CHUNK - numel))
        chunks = chunks.view(-1, CHUNK)
        magnitudes, indices = chunks.abs().topk(self.k, dim=1)
        levels, is_hi = _two_levels(magnitudes)
        negative = (chunks.gather(1, indices) < 0).to(torch.uint8)
        indices, order = indices.sort(dim=1)
        codes = is_hi.gather(1, order) | (negative.gather(1, order) << 1)
        low, high = self._pack_indices(indices.numpy())
        return (
            levels.numpy().astype("<f4", copy=False).tobytes()
            + low.tobytes()
            + high.tobytes()
            + pack_codes(codes.view(-1, _CODES_PER_BYTE)).numpy().tobytes()
        )

    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        view = check_length(self, data, numel)
        num_chunks = num_blocks(numel, CHUNK)
        levels, indices, codes = self._parse(view, num_chunks)
        return scatter_chunks(levels, indices, codes, CHUNK, numel)

    def decode_view(self, data: Buffer, numel: int) -> torch.Tensor:
        return self.decode(data, numel)

    def _pack_indices(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sorted (chunks, k) indices -> the low bit fields and the high bitvectors."""
        num_chunks, shift = indices.shape[0], self.low_bits
        low = (indices[:, :, None] >> np.arange(shift)) & 1
        low_fields = np.packbits(low.reshape(num_chunks, -1).astype(np.uint8), 1, "little")
        high = np.zeros((num_chunks, self.high_bits), dtype=np.uint8)
        np.put_along_axis(high, (indices >> shift) + np.arange(self.k), 1, axis=1)
        return low_fields, np.packbits(high, 1, "little")

    def _parse(
        self, view: memoryview, num_chunks: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Levels (chunks, 2), indices (chunks, k) and codes (chunks, k), all checked."""
        levels = torch.from_numpy(np.frombuffer(view, "<f4", 2 * num_chunks).astype(np.float32))
        if not bool(torch.isfinite(levels).all()) or bool((levels < 0).any()):
            raise CodecError("topk payload has a negative or non-finite level.")
        start = _LEVEL_BYTES * num_chunks
        low_bytes, high_bytes = self.k * self.low_bits // 8, self.high_bits // 8
        low = self._field(view, start, num_chunks, low_bytes)
        start += num_chunks * low_bytes
        high = self._field(view, start, num_chunks, high_bytes)
        start += num_chunks * high_bytes
        indices = torch.from_numpy(self._indices(low, high))
        packed = torch.from_numpy(np.frombuffer(view, np.uint8, offset=start).copy())
        codes = unpack_codes(packed).view(num_chunks, self.k)
        return levels.view(num_chunks, 2), indices, codes

    @staticmethod
    def _field(view: memoryview, start: int, num_chunks: int, width: int) -> np.ndarray:
        """``num_chunks`` rows of ``width`` bytes from ``start``, unpacked to bits."""
        raw = np.frombuffer(view, np.uint8, num_chunks * width, offset=start)
        return np.unpackbits(raw.reshape(num_chunks, width), axis=1, bitorder="little")

    def _indices(self, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        """(chunks, k) int64 indices from unpacked low fields and high bitvectors."""
        num_chunks = high.shape[0]
        if bool((high.sum(axis=1, dtype=np.int64) != self.k).any()):
            raise CodecError(f"topk payload has a high bitvector without exactly {self.k} bits.")
        _, set_bits = np.nonzero(high)  # row-major: each chunk's set bits in order
        high_parts = set_bits.reshape(num_chunks, self.k) - np.arange(self.k)
        low_parts = low.reshape(num_chunks, self.k, self.low_bits).astype(np.int64)
        indices = (high_parts << self.low_bits) | (low_parts << np.arange(self.low_bits)).sum(2)
        if bool((indices >= CHUNK).any()) or bool((np.diff(indices, axis=1) <= 0).any()):
            raise CodecError("topk payload indices are out of range or not increasing.")
        return indices


def _two_levels(magnitudes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each chunk's kept magnitudes (chunks, k) as two levels (lo, hi) and which entries take
    hi: the means of the larger and smaller half, then one step of 2-means (Lloyd) from
    there: an entry takes the nearer level and each level becomes its entries' mean. That
    step never raises the quantization error, and kept zeros (a chunk with fewer than k
    nonzero entries) decode to zero instead of to the lower half's mean."""
    half = magnitudes.shape[1] // 2
    ordered = magnitudes.sort(dim=1, descending=True).values
    first_hi, first_lo = ordered[:, :half].mean(1), ordered[:, half:].mean(1)
    is_hi = magnitudes > ((first_hi + first_lo) / 2)[:, None]
    hi = _mean_where(magnitudes, is_hi, first_hi)
    lo = _mean_where(magnitudes, ~is_hi, first_lo)
    return torch.stack((lo, hi), 1), is_hi.to(torch.uint8)


def _mean_where(values: torch.Tensor, mask: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """Row means of ``values`` where ``mask``; ``empty`` for rows where it is all False."""
    count = mask.sum(1)
    total = torch.where(mask, values, 0).sum(1)
    return torch.where(count > 0, total / count.clamp(min=1), empty)
