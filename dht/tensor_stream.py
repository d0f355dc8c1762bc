"""Tensors over a byte stream without serializing them whole: a JSON tree with placeholders,
then each tensor's raw bytes in chunks, written from and read into the tensor's own memory."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dht.transport import StreamBroken

CHUNK_BYTES = 1 << 20
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "int64": torch.int64}  # fmt: skip
MAX_DIMS = 8
PLACEHOLDER = "__tensor__"


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def split_tensors(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """`tree` (dicts, lists, JSON values, tensors) with each tensor replaced by a placeholder."""
    tensors: list[torch.Tensor] = []

    def walk(node: Any) -> Any:
        if isinstance(node, torch.Tensor):
            tensors.append(node)
            return {PLACEHOLDER: len(tensors) - 1}
        if isinstance(node, dict):
            return {str(key): walk(value) for key, value in node.items()}
        if isinstance(node, list | tuple):
            return [walk(value) for value in node]
        return node

    return walk(tree), tensors


def join_tensors(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of split_tensors, for an untrusted tree: ValueError on a bad placeholder."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if set(node) == {PLACEHOLDER}:
                index = node[PLACEHOLDER]
                if type(index) is not int or not 0 <= index < len(tensors):
                    raise ValueError("state names a tensor it did not send")
                return tensors[index]
            return {key: walk(value) for key, value in node.items()}
        if isinstance(node, list):
            return [walk(value) for value in node]
        return node

    return walk(tree)


def tensor_spec(tensor: torch.Tensor) -> dict[str, Any]:
    dtype = str(tensor.dtype).removeprefix("torch.")
    return {"dtype": dtype, "shape": list(tensor.shape)}


def parse_spec(spec: object) -> TensorSpec:
    if not isinstance(spec, dict) or spec.get("dtype") not in DTYPES:
        raise ValueError("state announces a tensor of an unknown dtype")
    shape = spec.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(type(size) is int and 0 <= size < 1 << 40 for size in shape)
    ):
        raise ValueError("state announces a tensor of a malformed shape")
    return TensorSpec(DTYPES[spec["dtype"]], tuple(shape))


class Hasher(Protocol):
    def update(self, data: memoryview | bytes, /) -> object: ...


async def send_tensor(
    writer: asyncio.StreamWriter, tensor: torch.Tensor, hasher: Hasher | None = None
) -> int:
    """Write the tensor's bytes (CPU, contiguous) in chunks, each into `hasher` too; the
    number of bytes written."""
    raw = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
    view = raw.data.cast("B")
    for offset in range(0, len(view), CHUNK_BYTES):
        chunk = view[offset : offset + CHUNK_BYTES]
        if hasher is not None:
            hasher.update(chunk)
        writer.write(chunk)
        await writer.drain()
    return len(view)


async def receive_tensor(
    reader: asyncio.StreamReader,
    spec: TensorSpec,
    *,
    read_timeout_s: float,
    hasher: Hasher | None = None,
) -> torch.Tensor:
    """Read exactly spec.nbytes into a fresh tensor of that dtype and shape, chunk by chunk
    (each into `hasher` too); TimeoutError when no byte arrived for `read_timeout_s` (a slow
    link is fine)."""
    buffer = torch.empty(spec.nbytes, dtype=torch.uint8)
    target = buffer.numpy().data.cast("B")
    offset = 0
    try:
        while offset < spec.nbytes:
            size = min(CHUNK_BYTES, spec.nbytes - offset)
            chunk = await asyncio.wait_for(reader.read(size), read_timeout_s)  # what arrived
            if not chunk:
                raise asyncio.IncompleteReadError(b"", spec.nbytes - offset)
            target[offset : offset + len(chunk)] = chunk
            if hasher is not None:
                hasher.update(chunk)
            offset += len(chunk)
    except asyncio.IncompleteReadError as exc:
        raise StreamBroken("peer closed the state stream early") from exc
    return buffer.view(spec.dtype).reshape(spec.shape)
