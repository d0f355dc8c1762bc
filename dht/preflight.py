"""Checks before p2pd starts, so that its usual failures become one line naming the cause.

p2pd reports a busy port or an unreachable bootstrap peer as a timeout or a Go error deep in
a traceback; these checks find the same causes first, with plain sockets.
"""

from __future__ import annotations

import errno
import socket
from concurrent.futures import ThreadPoolExecutor

from multiaddr import Multiaddr

from dht.addresses import NETWORKS


class PreflightError(ValueError):
    """A cause p2pd would fail on, in one line that names the flag to change."""


def check_port_free(host: str, port: int) -> None:
    """PreflightError if TCP `port` on `host` is taken (port 0 is always free)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As p2pd binds (SO_REUSEADDR): a port held only by TIME_WAIT is not "in use".
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                reason = exc.strerror or type(exc).__name__
                raise PreflightError(f"cannot listen on {host} port {port}: {reason}") from None
            raise PreflightError(
                f"port {port} on {host} is in use (another node on this machine?); "
                "pick another with --port (0: any free port)"
            ) from None


def tcp_endpoint(maddr: str) -> tuple[str, int] | None:
    """(host, port) of a /ip4|ip6|dns*/HOST/tcp/PORT address; None for other transports."""
    items = list(Multiaddr(maddr).items())
    if len(items) < 2 or items[0][0].name not in NETWORKS or items[1][0].name != "tcp":
        return None
    return str(items[0][1]), int(items[1][1])


def can_connect(endpoint: tuple[str, int], timeout_s: float) -> bool:
    try:
        with socket.create_connection(endpoint, timeout=timeout_s):
            return True
    except OSError:
        return False


def check_bootstrap_reachable(peers: list[str], timeout_s: float = 5.0) -> None:
    """PreflightError if none of `peers` accepts a TCP connection.

    Addresses over other transports (QUIC) cannot be probed this way and count as reachable.
    """
    endpoints = [tcp_endpoint(p) for p in peers]
    if not peers or any(e is None for e in endpoints):
        return
    with ThreadPoolExecutor(max_workers=min(8, len(peers))) as pool:
        results = list(pool.map(lambda e: can_connect(e, timeout_s), endpoints))
    if not any(results):
        shown = ", ".join(peers[:3]) + (f" (and {len(peers) - 3} more)" if len(peers) > 3 else "")
        raise PreflightError(
            f"no bootstrap peer reachable at {shown}; check --peers and that the node "
            "there is running and reachable from here"
        )
