"""Talking to this node's p2pd where hivemind's P2P has no call that serves: starting it in its
own session (keeping its pid for the orphan reaper), and opening streams or connections on
its control socket that are closed however the request ends.

Everything here uses hivemind's public parts: `P2P.daemon_listen_maddr` and the daemon
bindings (DaemonConnector, the protobuf framing); nothing reads P2P's private attributes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.control import DaemonConnector
from hivemind.p2p.p2p_daemon_bindings.utils import (
    ControlFailure,
    raise_if_failed,
    read_pbmsg_safe,
    write_pbmsg,
)
from hivemind.proto import p2pd_pb2
from multiaddr import Multiaddr

from dht.transport import TransportError


async def open_stream(connector: DaemonConnector, peer_id: str, protocol: str) -> tuple[Any, Any]:
    """(reader, writer) of a new stream to `peer_id` speaking `protocol`.

    hivemind's P2P.call_binary_stream_handler leaves its daemon connection open when the
    daemon refuses the stream (unreachable peer, unknown protocol) or the call is cancelled:
    one socket leaked per failed fetch until a garbage collection. This speaks the same
    STREAM_OPEN request, and closes the connection on every failure (TransportError when the
    daemon refuses).
    """
    request = p2pd_pb2.Request(
        type=p2pd_pb2.Request.STREAM_OPEN,
        streamOpen=p2pd_pb2.StreamOpenRequest(
            peer=PeerID.from_base58(peer_id).to_bytes(), proto=[protocol]
        ),
    )
    try:
        return await _ask(connector, request)
    except ControlFailure as exc:  # unreachable, or no such handler: a transport failure
        raise TransportError(f"no stream to {peer_id}: {exc}") from None


async def connect(connector: DaemonConnector, peer_id: str, maddrs: list[Multiaddr]) -> None:
    """Dial `peer_id` at `maddrs` (ControlFailure when the daemon could not, e.g. the peer at
    that address has another id)."""
    request = p2pd_pb2.Request(
        type=p2pd_pb2.Request.CONNECT,
        connect=p2pd_pb2.ConnectRequest(
            peer=PeerID.from_base58(peer_id).to_bytes(), addrs=[m.to_bytes() for m in maddrs]
        ),
    )
    _, writer = await _ask(connector, request)
    writer.close()


async def _ask(connector: DaemonConnector, request: Any) -> tuple[Any, Any]:
    """Send one control request on a new connection; the connection, once the daemon said
    yes (ControlFailure, and the connection closed, when it said no)."""
    reader, writer = await connector.open_connection()
    try:
        await write_pbmsg(writer, request)
        response = p2pd_pb2.Response()
        await read_pbmsg_safe(reader, response)
        raise_if_failed(response)
    except BaseException:
        writer.close()
        raise
    return reader, writer


@contextlib.contextmanager
def children_in_own_session(spawned: list[int]) -> Iterator[None]:
    """Start p2pd in its own session (hivemind offers no option for it); the pid of every
    process started meanwhile is appended to `spawned` (P2P exposes no public pid).

    A terminal's Ctrl+C (SIGINT) and hang-up (SIGHUP) go to the whole foreground process
    group; in its own session p2pd is spared, so the node can still publish its last update
    and then stop p2pd itself. The orphan reaper still ends p2pd if the node dies.
    Only the swarm's loop thread spawns processes through asyncio while this is in effect.
    """
    original = asyncio.subprocess.create_subprocess_exec

    async def spawn(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        kwargs.setdefault("start_new_session", True)
        process = await original(*args, **kwargs)
        spawned.append(process.pid)
        return process

    asyncio.subprocess.create_subprocess_exec = spawn  # type: ignore[assignment]
    try:
        yield
    finally:
        asyncio.subprocess.create_subprocess_exec = original  # type: ignore[assignment]
