"""The swarm network's request/response streams (`SwarmNetwork`'s part): protocol names per
run, handlers served within per-peer budgets, and bounded requests, exchanges and sends."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hivemind.p2p import P2P
from hivemind.p2p.p2p_daemon_bindings.control import DaemonConnector

from dht.budget import StreamGuard, StreamLimits
from dht.p2pd import open_stream
from dht.records import RefusalCounts
from dht.rejections import Rejections
from dht.swarm_config import REQUEST_READ_TIMEOUT_S, SwarmConfig
from dht.transport import encode_request, receive_blob, send_blob

logger = logging.getLogger(__name__)
Handler = Callable[[Any, Any, Any], Awaitable[None]]


class NetworkStreams:
    """Streams over this node's p2pd; mixed into dht.network.SwarmNetwork, which starts p2pd
    and sets the attributes below."""

    config: SwarmConfig
    dht_refusals: RefusalCounts
    _reject: Rejections | None
    _refusals_seen: dict[str, int]
    _p2p: P2P | None
    _control: DaemonConnector | None
    on_heard: Callable[[str], None] | None = None
    """Called with a peer's id when a stream proves it alive (`_heard`; dht.swarm sets it)."""

    def protocol(self, name: str) -> str:
        return f"/diloco/{self.config.fingerprint[:16]}/{name}/1"

    async def add_handler(self, name: str, handler: Handler, limits: StreamLimits) -> None:
        """Serve `name` streams with `handler`, within `limits` per peer.

        A peer over its budget has its stream closed at once (counted as `<name>_rate` or
        `<name>_busy` against it); every stream ends by `limits.deadline_s` and its socket
        is closed, whatever the handler did.
        """
        assert self._p2p is not None
        guard = StreamGuard(limits)

        async def guarded(info: Any, reader: Any, writer: Any) -> None:
            peer_id = str(info.peer_id)
            refusal = guard.admit(peer_id, time.monotonic())
            try:
                if refusal is not None:  # closed unread: the cheapest answer to a flood
                    self._count(f"{name}_{refusal}", peer_id, f"{name} stream refused")
                    return
                self._heard(peer_id)
                try:
                    await asyncio.wait_for(handler(info, reader, writer), limits.deadline_s)
                except TimeoutError:
                    self._count(f"{name}_timeout", peer_id, f"{name} stream past its deadline")
            except Exception as exc:  # a handler's bug must not leak the stream
                logger.warning("%s stream from %s failed: %r", name, peer_id, exc)
            finally:
                if refusal is None:
                    guard.release(peer_id)
                writer.close()

        await self._p2p.add_binary_stream_handler(self.protocol(name), guarded)

    def sync_dht_refusals(self) -> None:
        """Counts what the DHT process refused since the last call (Rejections)."""
        now = self.dht_refusals.snapshot()
        delta = {r: n - self._refusals_seen.get(r, 0) for r, n in now.items()}
        self._refusals_seen = now
        if self._reject is not None:
            self._reject.add_dht_refusals(delta)

    def _heard(self, peer_id: str) -> None:
        """`peer_id` opened a stream to this node or answered one: it is alive now. libp2p
        authenticates the remote's id on every connection, relayed ones included."""
        if self.on_heard is not None:
            self.on_heard(peer_id)

    def _count(self, reason: str, peer_id: str, detail: str) -> None:
        if self._reject is not None:
            self._reject(reason, peer_id, detail, update=False)

    async def open_stream(self, peer_id: str, name: str) -> tuple[Any, Any]:
        """(reader, writer) of a new stream to `peer_id`'s `name` handler (dht.p2pd: closed
        on every failure, unlike hivemind's P2P.call_binary_stream_handler)."""
        assert self._control is not None
        return await open_stream(self._control, peer_id, self.protocol(name))

    async def request(
        self, peer_id: str, name: str, max_bytes: int, *args: Any, timeout_s: float
    ) -> bytes:
        """Send a small JSON request to `peer_id`'s `name` handler; its one-blob answer.

        Bounded by `timeout_s` in all (TimeoutError); the stream is closed however it ends.
        """
        request = encode_request(args=list(args))
        return await self.exchange(peer_id, name, request, max_bytes=max_bytes, timeout_s=timeout_s)

    async def exchange(
        self, peer_id: str, name: str, blob: bytes, *, max_bytes: int, timeout_s: float
    ) -> bytes:
        """Send `blob` to `peer_id`'s `name` handler; its one-blob answer, within `timeout_s`
        in all and with no stall over REQUEST_READ_TIMEOUT_S (TimeoutError). The stream is
        closed however it ends."""
        async with asyncio.timeout(timeout_s):
            reader, writer = await self.open_stream(peer_id, name)
            try:
                await send_blob(writer, blob)
                answer = await receive_blob(
                    reader, max_bytes=max_bytes, stall_timeout_s=REQUEST_READ_TIMEOUT_S
                )
            finally:
                writer.close()
        self._heard(peer_id)
        return answer

    async def send(self, peer_id: str, name: str, blob: bytes, *, timeout_s: float = 10.0) -> None:
        """One blob to `peer_id`'s `name` handler, no answer expected; bounded by `timeout_s`."""
        async with asyncio.timeout(timeout_s):
            _, writer = await self.open_stream(peer_id, name)
            try:
                await send_blob(writer, blob)
            finally:
                writer.close()
