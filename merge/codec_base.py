"""What every payload codec shares: the error type, the interface and the input checks.

A codec turns a flat fp32 pseudo-gradient into bytes and back. Decoders face bytes from
untrusted peers: each one derives the exact payload length from ``numel`` alone and checks it
before it allocates anything, and raises only :class:`CodecError` for bad input.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

Buffer = bytes | bytearray | memoryview
"""What decoders read: a received payload, or a view of one inside its envelope."""

MAX_NUMEL = 2**40
"""Larger vectors are refused before any size arithmetic (a 4 TiB fp32 model)."""


class CodecError(ValueError):
    """A payload cannot be encoded or decoded with the chosen codec."""


class Codec(Protocol):
    """Turns a 1-D fp32 CPU tensor into bytes and back."""

    @property
    def name(self) -> str:
        """The name that update headers carry."""
        ...

    @property
    def error_feedback(self) -> bool:
        """True when what a payload drops should be carried into the next round's."""
        ...

    def payload_bytes(self, numel: int) -> int:
        """The exact length of the payload of a vector of ``numel`` elements."""
        ...

    def encode(self, flat: torch.Tensor) -> bytes:
        """Encodes a 1-D fp32 CPU tensor, little-endian."""
        ...

    def decode(self, data: Buffer, numel: int) -> torch.Tensor:
        """Decodes into a fresh, writable 1-D fp32 tensor of ``numel`` elements."""
        ...

    def decode_view(self, data: Buffer, numel: int) -> torch.Tensor:
        """Like decode, but the result may share memory with ``data``: never write to it."""
        ...


@runtime_checkable
class DecodesInto(Protocol):
    """A codec that can decode into a caller's buffer: the merge path reuses one across
    updates instead of faulting in a fresh model-sized vector each time."""

    def decode_into(self, data: Buffer, numel: int, out: torch.Tensor) -> torch.Tensor:
        """Decodes into ``out`` (a contiguous 1-D fp32 CPU tensor of ``numel`` elements) and
        returns it; the same values as :meth:`Codec.decode`."""
        ...


def check_out(out: object, numel: int) -> torch.Tensor:
    """``out`` if it can take a decoded vector of ``numel`` elements; ValueError otherwise
    (the caller's buffer is not network input)."""
    if (
        not isinstance(out, torch.Tensor)
        or out.shape != (numel,)
        or out.dtype != torch.float32
        or out.device.type != "cpu"
        or not out.is_contiguous()
    ):
        raise ValueError(f"decode_into needs a contiguous fp32 CPU tensor of {numel} elements.")
    return out


def check_flat(flat: torch.Tensor) -> None:
    """Raises CodecError unless ``flat`` is a 1-D fp32 CPU tensor."""
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise CodecError("codecs encode 1-D tensors only.")
    if flat.dtype != torch.float32 or flat.device.type != "cpu":
        raise CodecError(f"codecs encode fp32 CPU tensors, got {flat.dtype} on {flat.device}.")


def check_numel(numel: object) -> int:
    """``numel`` as an int in [0, MAX_NUMEL]; CodecError otherwise."""
    if type(numel) is not int or not 0 <= numel <= MAX_NUMEL:
        raise CodecError(f"numel must be an integer in [0, 2**40], got {numel!r}.")
    return numel


def check_length(codec: Codec, data: object, numel: int) -> memoryview:
    """A flat byte view of ``data`` after checking its length against ``numel``."""
    expected = codec.payload_bytes(check_numel(numel))
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"{codec.name} payload must be bytes, got {type(data).__name__}.")
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        raise CodecError(f"{codec.name} payload must be a flat byte buffer.")
    if view.nbytes != expected:
        raise CodecError(
            f"{codec.name} payload of {numel} elements needs {expected} bytes, got {view.nbytes}."
        )
    return view


def num_blocks(numel: int, block: int) -> int:
    """Blocks of ``block`` elements needed to hold ``numel`` elements."""
    return -(-numel // block)
