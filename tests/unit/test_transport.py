"""Blobs over a stream: a slow sender is waited for, a stalled one is cut, an oversized one
is refused before anything of it is read."""

from __future__ import annotations

import asyncio

import pytest

from dht.transport import HEADER, OK, TooLargeError, TransportError, receive_blob


async def _dribble(reader: asyncio.StreamReader, data: bytes, step: int, pause_s: float) -> None:
    for offset in range(0, len(data), step):
        reader.feed_data(data[offset : offset + step])
        await asyncio.sleep(pause_s)


def test_a_slow_but_steady_sender_is_read_whole() -> None:
    """200 KiB in 64 KiB steps, 0.15 s apart: slower than the stall timeout in all, never
    silent for that long."""
    payload = bytes(range(256)) * 800

    async def run() -> bytes:
        reader = asyncio.StreamReader()
        feed = asyncio.create_task(
            _dribble(reader, HEADER.pack(OK, len(payload)) + payload, 64 << 10, 0.15)
        )
        try:
            return await receive_blob(reader, max_bytes=1 << 20, stall_timeout_s=0.5)
        finally:
            await feed

    assert asyncio.run(run()) == payload


def test_a_stalled_sender_is_cut_and_an_oversized_blob_refused_unread() -> None:
    async def stalled() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(HEADER.pack(OK, 1000) + b"x" * 10)  # then nothing
        await receive_blob(reader, max_bytes=1 << 20, stall_timeout_s=0.05)

    with pytest.raises(TimeoutError):
        asyncio.run(stalled())

    async def oversized() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(HEADER.pack(OK, 1 << 40))  # no payload needed to refuse it
        await receive_blob(reader, max_bytes=1 << 20, stall_timeout_s=0.05)

    with pytest.raises(TooLargeError, match="cap"):
        asyncio.run(oversized())

    async def closed() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(HEADER.pack(OK, 100) + b"x")
        reader.feed_eof()
        await receive_blob(reader, max_bytes=1 << 20, stall_timeout_s=0.05)

    with pytest.raises(TransportError, match="early"):
        asyncio.run(closed())


class _AbortingWriter:
    """A stream whose peer goes away after `chunks` chunks were taken."""

    def __init__(self, chunks: int) -> None:
        self.taken = 0
        self.chunks = chunks

    def write(self, data: bytes | memoryview) -> None:
        self.taken += 1

    async def drain(self) -> None:
        if self.taken > self.chunks + 1:  # the header, then `chunks` chunks
            raise ConnectionResetError("peer went away")


def test_an_aborted_send_counts_only_what_left() -> None:
    from dht.transport import CHUNK_BYTES, WIRE_BYTES, send_blob

    sent_before, _ = WIRE_BYTES.totals()
    with pytest.raises(ConnectionResetError):
        asyncio.run(send_blob(_AbortingWriter(2), bytes(10 * CHUNK_BYTES)))  # type: ignore[arg-type]
    sent, _ = WIRE_BYTES.totals()
    assert sent - sent_before == HEADER.size + 2 * CHUNK_BYTES
