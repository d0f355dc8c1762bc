"""Blockwise absmax quantization to int8 and int4: one fp32 scale per block of elements.

Each block of ``block`` consecutive elements is scaled by its largest magnitude so that it
maps onto the integers [-qmax, qmax], then rounded to nearest. An element is off by at most
half a step, ``absmax(block) / (2 * qmax)``.

Payload layout (little-endian): ``num_blocks`` fp32 scales (absmax / qmax, in
[0, fp32 max / (qmax + 1)], so that decoded values are finite),
then the codes: int8 one byte per element; int4 two elements per byte, element 2i in the low
nibble and 2i+1 in the high nibble, each stored as code + 8 (so nibble 0 never occurs), an odd
count padded with the nibble of code 0.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from merge.codec_base import Buffer, CodecError, check_flat, check_length, num_blocks


class _BlockwiseCodec:
    """Shared by int8 and int4: scales, rounding and the checks on decoded scales."""

    name: str
    block: int
    qmax: int
    error_feedback = True

    def _code_bytes(self, numel: int) -> int:
        raise NotImplementedError

    def payload_bytes(self, numel: int) -> int:
        return 4 * num_blocks(numel, self.block) + self._code_bytes(numel)

    def quantize(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scales (one per block) and int8 codes in [-qmax, qmax] (one per element)."""
        check_flat(flat)
        numel = flat.numel()
        blocks = F.pad(flat.detach(), (0, num_blocks(numel, self.block) * self.block - numel))
        blocks = blocks.view(-1, self.block)
        scales = blocks.abs().amax(dim=1) / self.qmax
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / divisor[:, None]).clamp_(-self.qmax, self.qmax)
        return scales, codes.to(torch.int8).view(-1)[:numel]

    def _scales(self, view: memoryview, numel: int) -> torch.Tensor:
        count = num_blocks(numel, self.block)
        scales = torch.empty(count, dtype=torch.float32)
        scales.numpy()[:] = np.frombuffer(view, dtype="<f4", count=count)
        largest = torch.finfo(torch.float32).max / (self.qmax + 1)
        if not bool(((scales >= 0) & (scales <= largest)).all()):  # NaN fails both
            raise CodecError(f"{self.name} payload has a scale out of range or not finite.")
        return scales

    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        raise NotImplementedError

    def decode_view(self, data: Buffer, numel: int) -> torch.Tensor:
        return self.decode(data, numel)

    def _dequantize(self, codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        out = torch.empty(numel, dtype=torch.float32)
        full = numel // self.block * self.block
        torch.mul(
            codes[:full].view(-1, self.block),
            scales[: full // self.block, None],
            out=out[:full].view(-1, self.block),
        )
        if full < numel:
            torch.mul(codes[full:numel], scales[-1], out=out[full:])
        return out


class Int8Codec(_BlockwiseCodec):
    """int8 codes in [-127, 127], blocks of 256: 1.016 bytes per element."""

    name = "int8"
    block = 256
    qmax = 127

    def _code_bytes(self, numel: int) -> int:
        return numel

    def encode(self, flat: torch.Tensor) -> bytes:
        scales, codes = self.quantize(flat)
        return _le_f32(scales) + codes.numpy().tobytes()

    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        view = check_length(self, data, numel)
        scales = self._scales(view, numel)
        codes = torch.from_numpy(np.frombuffer(view[4 * scales.numel() :], dtype=np.int8).copy())
        if bool((codes == -128).any()):
            raise CodecError("int8 payload has the code -128, outside [-127, 127].")
        return self._dequantize(codes, scales, numel)


class Int4Codec(_BlockwiseCodec):
    """int4 codes in [-7, 7], blocks of 64: 0.5625 bytes per element."""

    name = "int4"
    block = 64
    qmax = 7

    def _code_bytes(self, numel: int) -> int:
        return -(-numel // 2)

    def encode(self, flat: torch.Tensor) -> bytes:
        scales, codes = self.quantize(flat)
        nibbles = F.pad(codes.to(torch.uint8) + 8, (0, codes.numel() % 2), value=8)
        pairs = nibbles.view(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
        return _le_f32(scales) + packed.numpy().tobytes()

    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        view = check_length(self, data, numel)
        scales = self._scales(view, numel)
        packed = torch.from_numpy(np.frombuffer(view[4 * scales.numel() :], dtype=np.uint8).copy())
        nibbles = torch.stack((packed & 15, packed >> 4), dim=1).view(-1)
        if bool((nibbles == 0).any()) or (numel % 2 and int(nibbles[-1]) != 8):
            raise CodecError("int4 payload has a nibble outside the codes it can hold.")
        codes = nibbles.to(torch.int8) - 8
        return self._dequantize(codes, scales, numel)


def _le_f32(values: torch.Tensor) -> bytes:
    return values.numpy().astype("<f4", copy=False).tobytes()
