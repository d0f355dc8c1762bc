"""`diloco-node doctor`: can the world reach this node, and through what?

Two parts: `Verdict`, a pure function of what was observed (bootstrap probes, AutoNAT's
answer, this node's addresses), which writes the few lines a user reads; and `diagnose`, the
probe that observes, with the same p2pd settings `join` uses (dht.reachability).

Observed:
- each bootstrap peer: a TCP connection (refused, timed out, unreachable), then a libp2p
  handshake that checks the peer id the address names (wrong peer id);
- reachability: p2pd's AutoNAT asks the connected peers to dial this node back (~15 s); its
  answer (public, private) is read from p2pd's log;
- a relayed address (/p2p-circuit): a relay reserved this node a slot;
- the addresses this node announces.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from multiaddr import Multiaddr

from dht.addresses import peer_id_of, without_peer_id
from dht.p2pd_log import P2PD_LOGGER
from dht.preflight import tcp_endpoint
from dht.reachability import (
    RelayLimits,
    daemon_flags,
    is_public,
    is_relayed,
    relay_of,
    tuned_p2p,
)

if TYPE_CHECKING:
    from hivemind.p2p import P2P

logger = logging.getLogger(__name__)
Outcome = Literal["ok", "refused", "timed out", "unreachable", "wrong peer id", "failed"]
NatStatus = Literal["public", "private", "unknown"]
AUTONAT_WAIT_S = 40.0
"""AutoNAT's first dial-back comes ~15 s after the first connection; a relay slot follows."""


@dataclass(frozen=True)
class BootstrapProbe:
    maddr: str
    outcome: Outcome
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class Observation:
    bootstraps: list[BootstrapProbe] = field(default_factory=list)
    nat_status: NatStatus = "unknown"
    announced: list[str] = field(default_factory=list)
    """This node's own addresses, as p2pd announces them, and its relayed ones."""
    port: int = 0


def is_public_maddr(maddr: str) -> bool:
    """Whether an address names a globally routable IP (not loopback, private, relayed)."""
    return not is_relayed(maddr) and is_public(maddr)


class Verdict:
    """What the observation means for the user, in a few lines."""

    def __init__(self, seen: Observation) -> None:
        self.seen = seen
        self.relayed = [m for m in seen.announced if is_relayed(m)]
        self.public = [m for m in seen.announced if is_public_maddr(m)]

    @property
    def bootstrap_ok(self) -> bool:
        return not self.seen.bootstraps or any(b.outcome == "ok" for b in self.seen.bootstraps)

    @property
    def kind(self) -> Literal["public", "relayed", "unreachable", "no bootstrap"]:
        if not self.bootstrap_ok:
            return "no bootstrap"
        if self.seen.nat_status == "public":
            return "public"
        if self.relayed:
            return "relayed"
        return "unreachable"

    @property
    def ok(self) -> bool:
        return self.kind in ("public", "relayed")

    def lines(self) -> list[str]:
        lines = [self._bootstrap_line(b) for b in self.seen.bootstraps]
        lines.append(self._reachability_line())
        shown = [m for m in self.seen.announced if not m.startswith("/ip4/127.")]
        lines.append("announces: " + (", ".join(shown) if shown else "no address"))
        advice = self._advice()
        if advice:
            lines.append("to change: " + advice)
        return lines

    @staticmethod
    def _bootstrap_line(probe: BootstrapProbe) -> str:
        if probe.outcome == "ok":
            return f"bootstrap {probe.maddr}: reachable"
        detail = f" ({probe.detail})" if probe.detail else ""
        return f"bootstrap {probe.maddr}: {probe.outcome}{detail}"

    def _reachability_line(self) -> str:
        kind = self.kind
        if kind == "no bootstrap":
            return "reachability: unknown, no bootstrap peer answered"
        if kind == "public":
            return "reachability: public, peers dial this node directly"
        relays = sorted({r for r in map(relay_of, self.relayed) if r})
        if kind == "relayed":
            return f"reachability: behind a NAT, reachable through relay {', '.join(relays)}"
        status = "behind a NAT" if self.seen.nat_status == "private" else "not confirmed"
        return f"reachability: {status}, and no relay holds a slot for it: no peer can reach it"

    def _advice(self) -> str:
        kind, port = self.kind, self.seen.port or "PORT"
        if kind == "no bootstrap":
            return "check --peers (copy the address a running node printed) and your firewall"
        if kind == "public":
            return ""
        forward = (
            f"forward TCP port {port} on your router to this machine and pass "
            f"--announce /ip4/YOUR_PUBLIC_IP/tcp/{port} (then peers dial it directly)"
        )
        if kind == "relayed":
            return f"nothing needed (relayed traffic is slower); to be direct, {forward}"
        return f"join with --auto-relay and a public node in --peers (it relays), or {forward}"


# ---- the probe ------------------------------------------------------------------------------


def probe_tcp(maddr: str, timeout_s: float) -> BootstrapProbe | None:
    """A failed TCP connection to a bootstrap address, or None when it connects (or is not
    TCP)."""
    endpoint = tcp_endpoint(maddr)
    if endpoint is None:
        return None
    host, port = endpoint
    try:
        with socket.create_connection(endpoint, timeout=timeout_s):
            return None
    except TimeoutError:
        return BootstrapProbe(maddr, "timed out", f"no answer from {host} in {timeout_s:.0f} s")
    except ConnectionRefusedError:
        return BootstrapProbe(maddr, "refused", f"nothing listens on {host} port {port}")
    except socket.gaierror as exc:
        return BootstrapProbe(maddr, "unreachable", f"cannot resolve {host}: {exc.strerror}")
    except OSError as exc:
        if exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
            return BootstrapProbe(maddr, "unreachable", f"no route to {host}")
        return BootstrapProbe(maddr, "failed", exc.strerror or type(exc).__name__)


class _NatStatusLog(logging.Handler):
    """Reads AutoNAT's verdict, and autorelay's reservations, from p2pd's log lines (hivemind
    forwards them; p2pd's own address list leaves relayed addresses out)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.status: NatStatus = "unknown"
        self.num_relays = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for status in ("public", "private"):
            if f"NAT status is {status}" in message:
                self.status = status  # type: ignore[assignment]
        if "adding new relay" in message:
            self.num_relays += 1


@contextlib.contextmanager
def _autonat_log() -> Iterator[_NatStatusLog]:
    handler = _NatStatusLog()
    p2pd_log = logging.getLogger(P2PD_LOGGER)
    saved = p2pd_log.level, p2pd_log.propagate, os.environ.get("GOLOG_LOG_LEVEL")
    os.environ["GOLOG_LOG_LEVEL"] = "error,autonat=debug,autorelay=debug"
    p2pd_log.setLevel(logging.DEBUG)
    p2pd_log.propagate = False
    p2pd_log.addHandler(handler)
    try:
        yield handler
    finally:
        p2pd_log.removeHandler(handler)
        p2pd_log.setLevel(saved[0])
        p2pd_log.propagate = saved[1]
        if saved[2] is None:
            os.environ.pop("GOLOG_LOG_LEVEL", None)
        else:
            os.environ["GOLOG_LOG_LEVEL"] = saved[2]


async def diagnose(
    peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str],
    *,
    wait_s: float = AUTONAT_WAIT_S,
    timeout_s: float = 5.0,
) -> Observation:
    """Observe this machine's reachability as `join` with these flags (and --auto-relay) would."""
    failed = await _tcp_failures(peers, timeout_s)
    reachable = [p for p in peers if p not in failed]
    flags = daemon_flags(use_auto_relay=True, initial_peers=reachable, limits=RelayLimits())
    with _autonat_log() as autonat:
        p2p = await tuned_p2p(flags).create(
            host_maddrs=host_maddrs,
            announce_maddrs=announce_maddrs or None,
            force_reachability="public" if announce_maddrs else None,
            trusted_relays=reachable or None,
            use_auto_relay=bool(reachable),
        )
        try:
            for maddr in reachable:
                failed.update(await _handshake(p2p, maddr, timeout_s))
            answered = [p for p in reachable if p not in failed]
            if peers and not answered:
                wait_s = 0.0  # nobody to dial this node back: nothing to wait for
            announced = await _await_reachability(p2p, autonat, wait_s, bool(announce_maddrs))
            if autonat.num_relays:
                announced += await _relayed_addresses(p2p, reachable)
        finally:
            await p2p.shutdown()
    port = next((e[1] for e in map(tcp_endpoint, announced) if e), 0)
    return Observation(
        bootstraps=[failed.get(p, BootstrapProbe(p, "ok")) for p in peers],
        nat_status="public" if announce_maddrs else autonat.status,
        announced=announced,
        port=port,
    )


async def probe_bootstraps(peers: list[str], timeout_s: float = 5.0) -> list[BootstrapProbe]:
    """Each bootstrap address's outcome: a TCP connection, then a libp2p handshake (from a
    throwaway p2pd) that checks the peer id the address names."""
    from hivemind.p2p import P2P

    failed = await _tcp_failures(peers, timeout_s)
    reachable = [p for p in peers if p not in failed]
    if reachable:
        p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            for maddr in reachable:
                failed.update(await _handshake(p2p, maddr, timeout_s))
        finally:
            await p2p.shutdown()
    return [failed.get(p, BootstrapProbe(p, "ok")) for p in peers]


async def _tcp_failures(peers: list[str], timeout_s: float) -> dict[str, BootstrapProbe]:
    loop = asyncio.get_running_loop()
    probes = await asyncio.gather(
        *(loop.run_in_executor(None, probe_tcp, p, timeout_s) for p in peers)
    )
    return {p.maddr: p for p in probes if p is not None}


async def _handshake(p2p: P2P, maddr: str, timeout_s: float) -> dict[str, BootstrapProbe]:
    """{} when the peer at `maddr` is the one its /p2p part names; else its failure."""
    from hivemind.p2p.p2p_daemon_bindings.control import DaemonConnector

    from dht.p2pd import connect

    expected = peer_id_of(Multiaddr(maddr))
    control = DaemonConnector(p2p.daemon_listen_maddr)
    try:
        await asyncio.wait_for(
            connect(control, expected, [without_peer_id(Multiaddr(maddr))]), timeout_s
        )
    except TimeoutError:
        return {maddr: BootstrapProbe(maddr, "timed out", "no libp2p handshake")}
    except Exception as exc:
        text = str(exc)
        if "mismatch" in text:
            detail = f"the node at that address is not {expected}"
            return {maddr: BootstrapProbe(maddr, "wrong peer id", detail)}
        return {maddr: BootstrapProbe(maddr, "failed", text.splitlines()[-1][:200])}
    return {}


async def _await_reachability(
    p2p: object, autonat: _NatStatusLog, wait_s: float, announced: bool
) -> list[str]:
    """This node's addresses once AutoNAT has answered (and a relay slot is held when private),
    or when `wait_s` is up."""
    deadline = time.monotonic() + wait_s
    while True:
        own = [str(m) for m in await p2p.get_visible_maddrs()]  # type: ignore[attr-defined]
        done = announced or autonat.status == "public" or autonat.num_relays > 0
        if done or time.monotonic() > deadline:
            return own
        await asyncio.sleep(1.0)


async def _relayed_addresses(p2p: object, relays: list[str]) -> list[str]:
    """This node's address through each of `relays` it is connected to (it holds a slot with
    them: the static relays are the only ones it asks)."""
    connected = {str(p.peer_id) for p in await p2p.list_peers()}  # type: ignore[attr-defined]
    own = str(p2p.peer_id)  # type: ignore[attr-defined]
    held = [r for r in relays if peer_id_of(Multiaddr(r)) in connected]
    return [f"{r}/p2p-circuit/p2p/{own}" for r in held]
