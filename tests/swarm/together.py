"""Starting a swarm's bootstrap and its joiners at once: the bootstrap's address is known
before it listens (its identity file gives the peer id, a port picked here the rest), and a
joiner that finds nobody listening there yet dials again with backoff (1, 2, 4, 8, 15 s:
dht.bootstrap_retry, the product's own behaviour for a busy bootstrap). A lone node's start
(~5-11 s, one core) then overlaps the joiners' instead of preceding it (docs/testing.md)."""

from __future__ import annotations

import socket

from merge.identity import Identity


def unused_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick, released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def bootstrap_address(identity_file: str, port: int) -> str:
    """The full address a node with `identity_file` listening on 127.0.0.1:`port` will have."""
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.load(identity_file).peer_id}"
