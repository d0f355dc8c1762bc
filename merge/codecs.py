"""Payload codecs: a flat fp32 pseudo-gradient to little-endian bytes and back.

Every update, the node's own included, is decoded from its payload before it is applied, so
all replicas apply the same numbers whatever the codec loses.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class CodecError(ValueError):
    """A payload cannot be encoded or decoded with the chosen codec."""


class Codec(Protocol):
    """Turns a 1-D fp32 CPU tensor into bytes and back."""

    @property
    def name(self) -> str:
        """The name that update headers carry."""
        ...

    @property
    def bytes_per_element(self) -> float:
        """Payload bytes per tensor element."""
        ...

    @property
    def max_relative_error(self) -> float:
        """Bound on |decoded - x| / |x| per element, for finite normal fp32 x."""
        ...

    def encode(self, flat: torch.Tensor) -> bytes:
        """Encodes a 1-D fp32 CPU tensor, little-endian."""
        ...

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        """Decodes into a fresh, writable 1-D fp32 tensor of ``numel`` elements."""
        ...


class Fp32Codec:
    """Lossless: the fp32 values themselves."""

    name = "fp32"
    bytes_per_element = 4.0
    max_relative_error = 0.0

    def encode(self, flat: torch.Tensor) -> bytes:
        _check_flat(flat)
        return flat.detach().contiguous().numpy().astype("<f4", copy=False).tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        _check_length(self, data, numel)
        values = np.frombuffer(data, dtype="<f4", count=numel).astype(np.float32)
        return torch.from_numpy(values)


class Bf16Codec:
    """bfloat16, rounded to nearest (ties to even) as torch rounds; half the bytes of fp32.

    bf16 keeps fp32's exponent range and 8 significant bits, hence the 2**-8 bound; fp32
    subnormals lose more, and values beyond bf16's largest finite value become infinite.
    """

    name = "bf16"
    bytes_per_element = 2.0
    max_relative_error = 2.0**-8

    def encode(self, flat: torch.Tensor) -> bytes:
        _check_flat(flat)
        bits = flat.detach().to(torch.bfloat16).view(torch.int16).numpy()
        return bits.astype("<i2", copy=False).tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        _check_length(self, data, numel)
        bits = np.frombuffer(data, dtype="<i2", count=numel).astype(np.int16)
        return torch.from_numpy(bits).view(torch.bfloat16).to(torch.float32)


CODECS: dict[str, Codec] = {codec.name: codec for codec in (Fp32Codec(), Bf16Codec())}


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except (KeyError, TypeError):
        raise CodecError(f"unknown codec {name!r}; known: {', '.join(CODECS)}") from None


def _check_flat(flat: torch.Tensor) -> None:
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise CodecError("codecs encode 1-D tensors only.")
    if flat.dtype != torch.float32 or flat.device.type != "cpu":
        raise CodecError(f"codecs encode fp32 CPU tensors, got {flat.dtype} on {flat.device}.")


def _check_length(codec: Codec, data: bytes, numel: int) -> None:
    if type(numel) is not int or numel < 0:
        raise CodecError(f"numel must be a non-negative integer, got {numel!r}.")
    expected = int(numel * codec.bytes_per_element)
    if len(data) != expected:
        raise CodecError(
            f"{codec.name} payload of {numel} elements needs {expected} bytes, got {len(data)}."
        )
