"""Payload codecs: a flat fp32 pseudo-gradient to little-endian bytes and back.

Every update, the node's own included, is decoded from its payload before it is applied, so
all replicas apply the same numbers whatever the codec loses. The lossy codecs (int8, int4,
sparse, topk) are meant to be used with error feedback (merge.feedback): what one round's payload
drops is carried into the next round's.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import torch

from merge.codec_base import Buffer, Codec, CodecError, check_flat, check_length, check_out
from merge.quantize import Int4Codec, Int8Codec
from merge.sparse import SparseTopKCodec
from merge.topk import TopKCodec

__all__ = ["CODECS", "Codec", "CodecError", "get_codec"]


class Fp32Codec:
    """Lossless: the fp32 values themselves."""

    name = "fp32"
    error_feedback = False
    max_relative_error = 0.0

    def payload_bytes(self, numel: int) -> int:
        return 4 * numel

    def encode(self, flat: torch.Tensor) -> bytes:
        check_flat(flat)
        return flat.detach().contiguous().numpy().astype("<f4", copy=False).tobytes()

    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        view = check_length(self, data, numel)
        out = torch.empty(numel, dtype=torch.float32)
        out.numpy()[:] = np.frombuffer(view, dtype="<f4", count=numel)
        return out

    def decode_view(self, data: Buffer, numel: int) -> torch.Tensor:
        """The payload's own memory read as fp32: no copy, the merge path's fast case."""
        view = check_length(self, data, numel)
        if sys.byteorder != "little" or numel == 0:
            return self.decode(data, numel)
        return _read_only_view(view, torch.float32, numel)


class Bf16Codec:
    """bfloat16, rounded to nearest (ties to even) as torch rounds; half the bytes of fp32.

    bf16 keeps fp32's exponent range and 8 significant bits, hence the 2**-8 bound; fp32
    subnormals lose more, and values beyond bf16's largest finite value become infinite.
    """

    name = "bf16"
    error_feedback = False
    max_relative_error = 2.0**-8

    def payload_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, flat: torch.Tensor) -> bytes:
        check_flat(flat)
        bits = flat.detach().to(torch.bfloat16).view(torch.int16).numpy()
        return bits.astype("<i2", copy=False).tobytes()

    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        """One pass: the payload's bf16 values widened straight into a fresh fp32 vector."""
        view = check_length(self, data, numel)
        return self._widen(view, numel, torch.empty(numel, dtype=torch.float32))

    def decode_into(self, data: Buffer, numel: int, out: torch.Tensor) -> torch.Tensor:
        """Like decode, into ``out``: a reused buffer is already faulted in, and a fresh
        model-sized one costs its page faults, more than the widening itself."""
        view = check_length(self, data, numel)
        return self._widen(view, numel, check_out(out, numel))

    def _widen(self, view: memoryview, numel: int, out: torch.Tensor) -> torch.Tensor:
        if sys.byteorder != "little" or numel == 0:
            bits = torch.empty(numel, dtype=torch.int16)
            bits.numpy()[:] = np.frombuffer(view, dtype="<i2", count=numel)
            return out.copy_(bits.view(torch.bfloat16))
        return out.copy_(_read_only_view(view, torch.bfloat16, numel))  # exact: bf16 fits fp32

    def decode_view(self, data: Buffer, numel: int) -> torch.Tensor:
        return self.decode(data, numel)


def _read_only_view(view: memoryview, dtype: torch.dtype, count: int) -> torch.Tensor:
    """The buffer's own memory as a tensor (never written: it may alias immutable bytes)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return torch.frombuffer(view, dtype=dtype, count=count)


CODECS: dict[str, Codec] = {
    codec.name: codec
    for codec in (
        Fp32Codec(),
        Bf16Codec(),
        Int8Codec(),
        Int4Codec(),
        SparseTopKCodec(),
        TopKCodec(),
    )
}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except (KeyError, TypeError):
        raise CodecError(f"unknown codec {name!r}; known: {', '.join(CODECS)}") from None
