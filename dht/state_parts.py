"""State downloads that survive cut streams: the donor keeps the bytes of one sealed state per
download, and the newcomer asks for them from where the last stream ended (dht.resumable).

A relayed connection between two NAT'd nodes is cut after ~128 KiB (dht.resumable says why),
and a state is megabytes. The donor serializes the sealed state once per download (the same
bytes `send_state` streams), keeps them while the newcomer comes back for more, and serves
parts of them; the newcomer checks the assembled bytes exactly as a streamed state
(`receive_state`: manifest, hashes, seal).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from dht.budget import PeerBudget
from dht.transport import TransportError

TRANSFER_ID = re.compile(r"[0-9a-f]{16}")
KEEP_S = 120.0
"""How long a serialized state waits for its newcomer's next part request."""
NEW_PER_S = 0.1
NEW_BURST = 3.0


class BufferWriter:
    """A stream writer that keeps what is written (send_state into memory)."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes | memoryview) -> None:
        self.data += chunk

    async def drain(self) -> None:
        await asyncio.sleep(0)  # serializing a large state must not hog the loop

    def close(self) -> None:
        pass


class SerializedStates:
    """The sealed states being downloaded, one per (newcomer, transfer id), in bounded memory:
    at most `max_states` at once and one per newcomer (a new download replaces its last), each
    dropped KEEP_S after its last request; a newcomer may start NEW_PER_S downloads per second
    on average (NEW_BURST at once), as many as the whole-stream protocol allowed.

    A state whose last part has been served is kept only while nothing else needs its room
    (its newcomer may still ask again if that part was lost): a new download evicts it instead
    of being told busy. Before, a donor that had served `max_states` whole downloads refused
    everyone for KEEP_S (session 13's settles: 13 of 15 refused by one donor)."""

    def __init__(self, max_states: int) -> None:
        self.max_states = max_states
        self._states: OrderedDict[tuple[str, str], tuple[bytes, float]] = OrderedDict()
        self._done: set[tuple[str, str]] = set()
        self._new = PeerBudget(rate_per_s=NEW_PER_S, burst=NEW_BURST)

    def get(self, key: tuple[str, str], now: float) -> bytes | None:
        self._expire(now)
        found = self._states.pop(key, None)
        if found is None:
            return None
        self._states[key] = (found[0], now)
        return found[0]

    def admit(self, newcomer: str, now: float) -> bool:
        """Whether `newcomer` may start a new download now (it then replaces its last one)."""
        self._expire(now)
        if not self._new.allow(newcomer, now):
            return False
        for key in [k for k in self._states if k[0] == newcomer]:
            self._drop(key)
        for key in [k for k in self._states if k in self._done]:  # oldest first
            if len(self._states) < self.max_states:
                break
            self._drop(key)
        return len(self._states) < self.max_states

    def served(self, key: tuple[str, str], end: int) -> None:
        """A part of `key` ending at byte `end` was answered: at the blob's end, the download
        is complete (its room may go to the next one)."""
        found = self._states.get(key)
        if found is not None and end >= len(found[0]):
            self._done.add(key)

    def put(self, key: tuple[str, str], blob: bytes, now: float) -> None:
        self._states[key] = (blob, now)
        while len(self._states) > self.max_states:
            self._drop(next(iter(self._states)))

    def _drop(self, key: tuple[str, str]) -> None:
        del self._states[key]
        self._done.discard(key)

    def _expire(self, now: float) -> None:
        for key in [k for k, (_, at) in self._states.items() if now - at > KEEP_S]:
            self._drop(key)

    def __len__(self) -> int:
        return len(self._states)


def parse_transfer_id(args: object) -> str:
    """The newcomer's transfer id (16 hex characters), from a request's args [id, offset]."""
    if not isinstance(args, list) or len(args) != 2 or not isinstance(args[0], str):
        raise TransportError("malformed request")
    if not TRANSFER_ID.fullmatch(args[0]):
        raise TransportError("malformed request: the transfer id is not 16 hex characters")
    return args[0]


async def serialized_state(
    states: SerializedStates,
    key: tuple[str, str],
    serialize: Callable[[BufferWriter], Awaitable[Any]],
) -> bytes | None:
    """The bytes of the download `key`: serialized on its first request (None when
    `max_states` downloads are already kept: the newcomer is told busy)."""
    now = time.monotonic()
    blob = states.get(key, now)
    if blob is not None:
        return blob
    if not states.admit(key[0], now):
        return None
    writer = BufferWriter()
    await serialize(writer)
    blob = bytes(writer.data)
    states.put(key, blob, time.monotonic())
    return blob
