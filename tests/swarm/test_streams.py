"""Streams between two real p2pd daemons (loopback, in this process): budgets, deadlines,
and no socket outliving its request.

Before: hivemind's stream open left its daemon connection open whenever the daemon refused
the stream (unreachable peer, unknown protocol), one socket per failed fetch until a garbage
collection happened to run; stream handlers had no deadline, so a peer that opened streams
and sent nothing held a socket each, forever.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dht.budget import StreamLimits
from dht.network import SwarmNetwork
from dht.rejections import Rejections
from dht.swarm_config import SwarmConfig
from dht.transport import TransportError, receive_blob, send_blob
from merge.identity import Identity

pytestmark = pytest.mark.swarm


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[SwarmNetwork, SwarmNetwork, Rejections]]:
    """Two networks of one run; the server counts its rejections."""
    started: list[SwarmNetwork] = []
    rejections = Rejections(lambda _result: None)

    def start(name: str, peers: list[str], reject: Rejections | None) -> SwarmNetwork:
        identity = Identity.generate()
        identity.save(tmp_path / f"{name}.key")
        config = SwarmConfig(
            run_id="streams",
            fingerprint="ab" * 32,
            run_summary={},
            identity_path=str(tmp_path / f"{name}.key"),
            initial_peers=peers,
        )
        network = SwarmNetwork(config, identity, reject)
        started.append(network)
        network.start(30.0)
        return network

    try:
        server = start("server", [], rejections)
        client = start("client", server.read_visible_maddrs(), None)
        yield server, client, rejections
    finally:
        for network in started:
            network.shutdown()


def test_failed_fetches_leave_no_socket_behind(
    pair: tuple[SwarmNetwork, SwarmNetwork, Rejections],
) -> None:
    server, client, _ = pair
    ghost = Identity.generate().peer_id  # nobody runs it: the daemon refuses at once

    async def fetch(peer_id: str) -> str:
        request = client.request(peer_id, "update", 1024, "author", 1, timeout_s=5.0)
        try:
            await asyncio.wait_for(request, 10.0)  # in a task, as background fetches run
        except TransportError:  # DialError too: no stream opened (the ghost, no handler)
            return "TransportError"
        except Exception as exc:
            return type(exc).__name__
        return "answered"

    gc.disable()  # sockets must be closed by the code, not by a collection (hivemind's stream
    # open, failing inside a task, leaked one even past gc.collect(): +200 here)
    try:
        outcomes = set(client.call(fetch(ghost), 10.0) for _ in range(3))  # warm up
        before = _open_fds()
        for _ in range(100):
            outcomes.add(client.call(fetch(ghost), 10.0))
            outcomes.add(client.call(fetch(server.peer_id), 10.0))  # no "update" handler
        after = _open_fds()
    finally:
        gc.enable()
    assert outcomes == {"TransportError"}
    assert after - before <= 4, f"{after - before} descriptors left after 200 failed fetches"


def test_a_stalled_stream_is_cut_and_a_flood_is_refused(
    pair: tuple[SwarmNetwork, SwarmNetwork, Rejections],
) -> None:
    server, client, rejections = pair
    limits = StreamLimits(rate_per_s=0.01, burst=3, max_in_flight=8, deadline_s=0.5)

    async def echo(_info: Any, reader: Any, writer: Any) -> None:
        await send_blob(writer, await receive_blob(reader, max_bytes=64))  # no timeout of its own

    server.call(server.add_handler("echo", echo, limits), 10.0)

    async def stall() -> float:
        """Open a stream, send nothing: the server must end it at its deadline."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        reader, writer = await client.open_stream(server.peer_id, "echo")
        try:
            with pytest.raises(TransportError, match="closed the stream early"):
                await asyncio.wait_for(receive_blob(reader, max_bytes=64), 10.0)
        finally:
            writer.close()
        return loop.time() - started

    async def ask() -> bytes:
        return await client.exchange(server.peer_id, "echo", b"hi", max_bytes=64, timeout_s=5.0)

    before = _open_fds()
    assert client.call(ask(), 10.0) == b"hi"
    assert 0.4 < client.call(stall(), 15.0) < 5.0
    assert rejections.log.by_peer()[client.peer_id] == {"echo_timeout": 1}
    assert client.call(ask(), 10.0) == b"hi"  # third and last of the burst
    for _ in range(20):  # the flooder is refused, cheaply, and each refusal counted
        with pytest.raises((TransportError, OSError)):
            client.call(ask(), 10.0)
    assert rejections.log.by_peer()[client.peer_id] == {"echo_timeout": 1, "echo_rate": 20}
    assert _open_fds() - before <= 4
