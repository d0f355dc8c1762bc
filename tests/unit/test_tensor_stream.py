"""Replica state streamed tensor by tensor: round trip, and a lying donor is refused."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dht.tensor_stream import (
    join_tensors,
    parse_spec,
    receive_tensor,
    send_tensor,
    split_tensors,
    tensor_spec,
)
from dht.transport import TransportError


class _Pipe:
    """A writer whose bytes a StreamReader reads: the two ends of one stream."""

    def __init__(self) -> None:
        self.reader = asyncio.StreamReader()

    def write(self, data: bytes | memoryview) -> None:
        self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        return None


def test_a_state_tree_round_trips_through_the_stream() -> None:
    state = {"params": torch.randn(3_000_000), "outer": {"kind": "nesterov", "count": 3,
             "buf": torch.randn(7).to(torch.bfloat16)}, "applied": {"a": [1, 2]}}  # fmt: skip

    async def round_trip() -> dict:
        tree, tensors = split_tensors(state)
        pipe = _Pipe()
        for tensor in tensors:
            await send_tensor(pipe, tensor)  # type: ignore[arg-type]
        specs = [parse_spec(tensor_spec(t)) for t in tensors]
        received = [await receive_tensor(pipe.reader, spec, read_timeout_s=5.0) for spec in specs]
        return join_tensors(tree, received)

    got = asyncio.run(round_trip())
    assert torch.equal(got["params"], state["params"])
    assert torch.equal(got["outer"]["buf"], state["outer"]["buf"])
    assert got["outer"]["count"] == 3 and got["applied"] == {"a": [1, 2]}


def test_a_donor_that_sends_less_or_lies_about_tensors_is_refused() -> None:
    async def short_read() -> None:
        pipe = _Pipe()
        pipe.write(b"\x00" * 10)
        pipe.reader.feed_eof()
        await receive_tensor(
            pipe.reader, parse_spec({"dtype": "float32", "shape": [4]}), read_timeout_s=5.0
        )

    with pytest.raises(TransportError):
        asyncio.run(short_read())
    for spec in ({"dtype": "object", "shape": [1]}, {"dtype": "float32", "shape": [-1]},
                 {"dtype": "float32", "shape": "big"}):  # fmt: skip
        with pytest.raises(ValueError):
            parse_spec(spec)
    with pytest.raises(ValueError):
        join_tensors({"params": {"__tensor__": 5}}, [])
