"""Checks before p2pd starts, so that its usual failures become one line naming the cause.

p2pd reports a busy port or an unreachable bootstrap peer as a timeout or a Go error deep in
a traceback; these checks find the same causes first, with plain sockets.
"""

from __future__ import annotations

import errno
import logging
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from multiaddr import Multiaddr

from dht.addresses import NETWORKS
from dht.bootstrap_retry import BootstrapRetry, RetryBounds, candidates

logger = logging.getLogger(__name__)


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


def connect_failure(endpoint: tuple[str, int], timeout_s: float) -> str | None:
    """Why a TCP connection to `endpoint` failed within `timeout_s`; None if it was accepted."""
    try:
        with socket.create_connection(endpoint, timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return (exc.strerror or type(exc).__name__).lower()


def can_connect(endpoint: tuple[str, int], timeout_s: float) -> bool:
    return connect_failure(endpoint, timeout_s) is None


def probe_peers(peers: list[str], timeout_s: float) -> dict[str, str | None]:
    """Each address's failure (None: reachable). Addresses over other transports (QUIC)
    cannot be probed with a TCP socket and count as reachable."""
    endpoints = [tcp_endpoint(p) for p in peers]
    if not peers:
        return {}
    with ThreadPoolExecutor(max_workers=min(8, len(peers))) as pool:
        failures = list(
            pool.map(lambda e: None if e is None else connect_failure(e, timeout_s), endpoints)
        )
    return dict(zip(peers, failures, strict=True))


def reach_peers(
    bootstrap: list[str],
    known: list[str],
    *,
    bounds: RetryBounds | None = None,
    timeout_s: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> list[str]:
    """The bootstrap and known peers that accept a connection, retried with bounded backoff
    (one log line per failed attempt); PreflightError once the bound is spent. With no
    bootstrap peers this node starts a swarm: nothing is dialled."""
    if not bootstrap:
        return []
    tried = candidates(bootstrap, known)
    retry = BootstrapRetry(bounds or RetryBounds(), clock)
    while True:
        failures = probe_peers(tried, timeout_s)
        reachable = [p for p in tried if failures[p] is None]
        if reachable:
            return reachable
        wait_s = retry.failed()
        if wait_s is None:
            raise _unreachable(bootstrap, tried, retry)
        logger.warning(
            "attempt %d: no peer reachable (%s); retrying in %.0f s, giving up after %.0f s",
            retry.num_failed,
            _shown_failures(failures),
            wait_s,
            retry.bounds.give_up_after_s,
        )
        sleep(wait_s)


def _shown_failures(failures: dict[str, str | None], limit: int = 3) -> str:
    shown = [f"{maddr}: {why}" for maddr, why in list(failures.items())[:limit]]
    more = len(failures) - limit
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


def _unreachable(bootstrap: list[str], tried: list[str], retry: BootstrapRetry) -> PreflightError:
    shown = ", ".join(bootstrap[:3]) + (
        f" (and {len(bootstrap) - 3} more)" if len(bootstrap) > 3 else ""
    )
    known = len(tried) - len(dict.fromkeys(bootstrap))
    also = f" nor at {known} peers known from the last run" if known else ""
    return PreflightError(
        f"no bootstrap peer reachable at {shown}{also} after {retry.num_failed} attempts "
        f"in {retry.elapsed_s:.0f} s; check --peers and that the node there is running and "
        "reachable from here"
    )


def check_bootstrap_reachable(peers: list[str], timeout_s: float = 5.0) -> None:
    """PreflightError if none of `peers` accepts a TCP connection, after one attempt.

    Addresses over other transports (QUIC) cannot be probed this way and count as reachable.
    """
    reach_peers(peers, [], bounds=RetryBounds(give_up_after_s=0), timeout_s=timeout_s)
