"""Bytes on the wire: every blob a node sends or receives over a peer stream is counted."""

import asyncio
import socket

import pytest

from dht.transport import HEADER, WIRE_BYTES, TransportError, receive_blob, send_blob


async def _exchange(blob: bytes, max_bytes: int) -> bytes:
    left, right = socket.socketpair()
    reader, left_writer = await asyncio.open_connection(sock=left)
    right_reader, writer = await asyncio.open_connection(sock=right)
    try:
        await send_blob(writer, blob)
        return await receive_blob(reader, max_bytes=max_bytes)
    finally:
        writer.close()
        left_writer.close()


def test_a_blob_counts_once_sent_and_once_received_with_its_framing() -> None:
    sent, received = WIRE_BYTES.totals()

    assert asyncio.run(_exchange(b"x" * 5000, max_bytes=8192)) == b"x" * 5000

    assert WIRE_BYTES.totals() == (sent + HEADER.size + 5000, received + HEADER.size + 5000)


def test_a_refused_oversized_blob_is_not_counted_as_received() -> None:
    _, received = WIRE_BYTES.totals()

    with pytest.raises(TransportError):
        asyncio.run(_exchange(b"x" * 5000, max_bytes=100))

    assert WIRE_BYTES.totals()[1] == received


def test_the_dashboard_sums_the_bytes_of_live_peers_only() -> None:
    from dashboard.view import PeerRecord, SwarmState, totals
    from dht.heartbeat import Heartbeat

    def record(peer: str, sent: int, received: int, alive: bool) -> PeerRecord:
        beat = Heartbeat(peer_id=peer, bytes_sent=sent, bytes_received=received)
        return PeerRecord(beat, alive=alive, last_seen_s=1.0)

    peers = [record("a", 100, 7, True), record("b", 20, 3, True), record("c", 5000, 9, False)]

    summed = totals(SwarmState("run", "", "standalone", peers, 0.0))

    assert (summed.bytes_sent, summed.bytes_received) == (120, 10)
