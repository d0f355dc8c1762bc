"""Length-prefixed blobs over libp2p streams, with a cap on what a peer may make us read."""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import time
from typing import Any

from merge.codec_uplink import UplinkMeter

HEADER = struct.Struct(">BQ")  # status byte, payload length
OK, REFUSED = 1, 0
CHUNK_BYTES = 1 << 20


class TransportError(ConnectionError):
    """A peer sent something we will not read, or refused a request."""


class TooLargeError(TransportError):
    """A peer announced a blob over the reader's cap (nothing of it was read)."""


class StreamBroken(TransportError):
    """The connection ended before a transfer was whole (the peer died, a relayed link was
    reset): nothing it sent was refused, so nothing is counted against it."""


STALL_CHUNK_BYTES = 64 << 10
"""Blobs are read this much at a time when a stall timeout is set: a chunk must arrive
within the timeout, so it is small enough to cross a slow link (64 KiB at 1 Mbit/s: 0.5 s)."""


class WireBytes:
    """Bytes this process moved over peer streams (blobs with their framing); thread-safe.

    One node per process: these are the node's bytes on the wire. hivemind's own DHT RPCs
    (heartbeat records, announcements in the DHT) are not counted.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sent = 0
        self._received = 0

    def add(self, *, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self._sent += sent
            self._received += received

    def totals(self) -> tuple[int, int]:
        """(sent, received) since the process started."""
        with self._lock:
            return self._sent, self._received


WIRE_BYTES = WireBytes()
UPLINK = UplinkMeter()
"""This process's uplink, measured from its sends (`--codec auto` picks its codec by it)."""


async def send_blob(writer: asyncio.StreamWriter, data: bytes, *, status: int = OK) -> None:
    """Counted chunk by chunk as the socket takes it: a stream the peer aborts (a fetch that
    timed out over a slow link) counts what left, not the whole blob. The same bytes over the
    time they took measure the uplink (UPLINK)."""
    sent = 0
    UPLINK.begin(time.monotonic())
    try:
        writer.write(HEADER.pack(status, len(data)))
        await writer.drain()
        WIRE_BYTES.add(sent=HEADER.size)
        sent += HEADER.size
        view = memoryview(data)
        for offset in range(0, len(view), CHUNK_BYTES):
            chunk = view[offset : offset + CHUNK_BYTES]
            writer.write(chunk)
            await writer.drain()
            WIRE_BYTES.add(sent=len(chunk))
            sent += len(chunk)
    finally:
        UPLINK.end(time.monotonic(), sent)


async def receive_blob(
    reader: asyncio.StreamReader, *, max_bytes: int, stall_timeout_s: float | None = None
) -> bytes:
    """The next blob; TransportError when the peer refused or announces more than max_bytes
    (TooLargeError). With `stall_timeout_s`, TimeoutError when no byte arrived for that long:
    a slow link is fine, a stalled one is not."""
    try:
        head = await _read(reader, HEADER.size, stall_timeout_s)
        status, length = HEADER.unpack(head)
        if length > max_bytes:
            raise TooLargeError(f"peer announced {length} bytes, more than the {max_bytes} cap")
        if stall_timeout_s is None:
            data = await reader.readexactly(length)
        else:
            parts = []
            for offset in range(0, length, STALL_CHUNK_BYTES):
                size = min(STALL_CHUNK_BYTES, length - offset)
                parts.append(await _read(reader, size, stall_timeout_s))
            data = b"".join(parts)
        WIRE_BYTES.add(received=HEADER.size + length)
    except asyncio.IncompleteReadError as exc:
        raise TransportError("peer closed the stream early") from exc
    if status == REFUSED:
        raise TransportError(f"peer refused: {data[:200].decode(errors='replace')}")
    if status != OK:
        raise TransportError(f"unknown status byte {status}")
    return data


async def _read(reader: asyncio.StreamReader, size: int, stall_timeout_s: float | None) -> bytes:
    if stall_timeout_s is None:
        return await reader.readexactly(size)
    return await asyncio.wait_for(reader.readexactly(size), stall_timeout_s)


async def send_refusal(writer: asyncio.StreamWriter, reason: str) -> None:
    await send_blob(writer, reason.encode(), status=REFUSED)


def encode_request(**fields: Any) -> bytes:
    return json.dumps(fields, sort_keys=True).encode()


def decode_request(data: bytes) -> dict[str, Any]:
    """A peer's JSON request: a dict, with no NaN or Infinity anywhere in it (Python's json
    accepts both; int(Infinity) raised OverflowError in a handler) and no nesting that
    exhausts the recursion limit; TransportError otherwise."""
    try:
        fields = json.loads(data, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):
        raise TransportError("malformed request") from None
    if not isinstance(fields, dict):
        raise TransportError("malformed request")
    return fields


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number a peer may send")
