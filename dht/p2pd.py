"""Talking to this node's p2pd where hivemind's P2P has no call that serves: starting it in its
own session (keeping its pid for the orphan reaper), opening streams or connections on its
control socket that are closed however the request ends, and reserving a relay slot.

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


class DialError(TransportError):
    """The daemon opened no stream at all (the peer unreachable: no route, a relayed address
    whose relay holds no slot for it, `NO_RESERVATION`; or no such handler): nothing was
    exchanged, so asking the same peer again at once rarely helps (dht.resumable)."""


async def open_stream(connector: DaemonConnector, peer_id: str, protocol: str) -> tuple[Any, Any]:
    """(reader, writer) of a new stream to `peer_id` speaking `protocol`.

    hivemind's P2P.call_binary_stream_handler leaves its daemon connection open when the
    daemon refuses the stream (unreachable peer, unknown protocol) or the call is cancelled:
    one socket leaked per failed fetch until a garbage collection. This speaks the same
    STREAM_OPEN request, and closes the connection on every failure (DialError when the
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
        raise DialError(f"no stream to {peer_id}: {exc}") from None


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


async def disconnect(connector: DaemonConnector, peer_id: str) -> None:
    """Close every connection of this node to `peer_id` (ControlFailure when the daemon
    refuses; no connection is no failure)."""
    request = p2pd_pb2.Request(
        type=p2pd_pb2.Request.DISCONNECT,
        disconnect=p2pd_pb2.DisconnectRequest(peer=PeerID.from_base58(peer_id).to_bytes()),
    )
    _, writer = await _ask(connector, request)
    writer.close()


HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
"""Circuit relay v2's protocol for reserving a slot with a relay (libp2p specs: circuit-v2)."""
RESERVE_REQUEST = b"\x02\x08\x00"
"""HopMessage{type: RESERVE}, length-prefixed (a uvarint) as circuit relay v2 frames it."""
HOP_STATUS_OK = 100
MAX_HOP_MESSAGE = 4096
"""go-libp2p's relay refuses longer messages; a longer answer is not a relay's."""


async def reserve_slot(connector: DaemonConnector, relay: str) -> int:
    """Ask `relay` for a slot (circuit relay v2 RESERVE) on this node's connection to it; the
    status it answered (HOP_STATUS_OK: granted). Peers reach this node at
    RELAY_ADDRESS/p2p-circuit/p2p/THIS_NODE while that connection lives.

    p2pd's autorelay reserves slots by itself, but never again with a relay it reserved with in
    the last hour (dht.bootstrap_reconnect): a relay that restarted is asked through here.
    TransportError when the relay does not speak the protocol or answers nonsense."""
    request = p2pd_pb2.Request(
        type=p2pd_pb2.Request.STREAM_OPEN,
        streamOpen=p2pd_pb2.StreamOpenRequest(
            peer=PeerID.from_base58(relay).to_bytes(), proto=[HOP_PROTOCOL]
        ),
    )
    try:
        reader, writer = await _ask(connector, request)
    except ControlFailure as exc:
        raise TransportError(f"no relay stream to {relay}: {exc}") from None
    try:
        writer.write(RESERVE_REQUEST)
        await writer.drain()
        length = await _read_uvarint(reader)
        if length > MAX_HOP_MESSAGE:
            raise TransportError(f"relay {relay} answered {length} bytes")
        return hop_status(await reader.readexactly(length))
    except (asyncio.IncompleteReadError, ValueError) as exc:
        raise TransportError(f"relay {relay} answered a malformed reservation: {exc}") from None
    finally:
        writer.close()


async def _read_uvarint(reader: Any) -> int:
    value = 0
    for shift in range(0, 35, 7):
        byte = (await reader.readexactly(1))[0]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value
    raise ValueError("length prefix over 5 bytes")


def hop_status(message: bytes) -> int:
    """The status field (5) of a circuit relay v2 HopMessage (0 when absent); ValueError when
    `message` is not a protobuf message. Other fields are skipped unread."""
    status, at = 0, 0
    while at < len(message):
        key, at = _varint(message, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(message, at)
            if field == 5:
                status = value
        elif wire == 2:
            size, at = _varint(message, at)
            at += size
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise ValueError(f"wire type {wire}")
        if at > len(message):
            raise ValueError("truncated")
    return status


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = 0
    for shift in range(0, 70, 7):
        if at >= len(data):
            raise ValueError("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
    raise ValueError("varint over 10 bytes")


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
