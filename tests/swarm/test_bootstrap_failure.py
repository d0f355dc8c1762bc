"""A node whose bootstrap address names another peer id says so (real p2pd, loopback).

Before: p2pd said only "failed to connect to bootstrap peers", whatever the cause; the TCP
preflight passes such an address (something listens there), so the user learnt nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dht.network import SwarmNetwork
from dht.swarm_config import SwarmConfig, SwarmError
from merge.identity import Identity
from tests.timeouts import covering

pytestmark = [pytest.mark.swarm, pytest.mark.lone]  # two daemons, no node: beside the swarm tests
START_S = 30.0


def network(tmp_path: Path, name: str, peers: list[str]) -> SwarmNetwork:
    identity = Identity.generate()
    identity.save(tmp_path / f"{name}.key")
    config = SwarmConfig(
        run_id="bootstrap-failure",
        fingerprint="cd" * 32,
        run_summary={},
        identity_path=str(tmp_path / f"{name}.key"),
        initial_peers=peers,
    )
    return SwarmNetwork(config, identity)


@pytest.mark.timeout(covering(START_S, START_S))
def test_a_bootstrap_address_with_another_peer_id_is_named_with_the_reason(
    tmp_path: Path,
) -> None:
    server = network(tmp_path, "server", [])
    server.start(START_S)
    try:
        real = server.read_visible_maddrs()[0]
        impostor = Identity.generate().peer_id
        wrong = f"{real.rsplit('/p2p/', 1)[0]}/p2p/{impostor}"
        client = network(tmp_path, "client", [wrong])
        try:
            with pytest.raises(SwarmError) as caught:
                client.start(START_S)
        finally:
            client.shutdown()
    finally:
        server.shutdown()
    message = str(caught.value)
    assert f"{wrong}: wrong peer id (the node at that address is not {impostor})" in message
