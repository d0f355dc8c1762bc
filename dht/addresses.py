"""Multiaddrs as users type them: --peers, --announce, --host/--port, and the join hint.

A peer address is `/<network>/<host>/<transport>/p2p/<peer id>`, where the network is ip4, ip6,
dns, dns4 or dns6 and the transport is /tcp/PORT, /udp/PORT/quic or /udp/PORT/quic-v1. Anything
between the transport and the final /p2p part (/ws, /p2p/<relay>/p2p-circuit) is passed through
to libp2p untouched.
"""

from __future__ import annotations

import ipaddress
import logging
import shlex

from multiaddr import Multiaddr
from multiaddr.exceptions import Error as MultiaddrError

logger = logging.getLogger(__name__)

NETWORKS = frozenset({"ip4", "ip6", "dns", "dns4", "dns6"})
QUIC = frozenset({"quic", "quic-v1"})
_EXPECTED = "/ip4, /ip6, /dns, /dns4 or /dns6 then /tcp/PORT or /udp/PORT/quic-v1"


class AddressError(ValueError):
    """A multiaddr, host or port given by the user that a node cannot use."""


def parse_peer_maddr(text: str) -> Multiaddr:
    """Parse one --peers entry: a dialable address ending with /p2p/<peer id>."""
    maddr = _parse_dialable(text, flag="--peers")
    if _names(maddr)[-1] != "p2p":
        raise AddressError(
            f"--peers: '{text}' has no /p2p/<peer id> part; "
            "copy the full address the first node printed"
        )
    return maddr


def parse_announce_maddr(text: str) -> Multiaddr:
    """Parse one --announce entry: a dialable address of this node.

    A trailing /p2p/<peer id> is stripped: libp2p appends this node's own id when it announces,
    and which id a copied address carried cannot be checked before the node knows its identity.
    """
    maddr = _parse_dialable(text, flag="--announce")
    if _names(maddr)[-1] == "p2p":
        logger.info("--announce: dropping the /p2p part of %s; the node announces its own id", text)
        maddr = without_peer_id(maddr)
    return maddr


LOCALHOST = "localhost"


def host_ip(host: str) -> str:
    """An IP address for --host: `localhost` is 127.0.0.1, anything else must be an IP."""
    host = host.strip()
    if host.lower() == LOCALHOST:
        return "127.0.0.1"
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        raise AddressError(
            f"--host must be an IP address such as 0.0.0.0 or 127.0.0.1 (or localhost), "
            f"got '{host}'"
        ) from None


def listen_maddrs(host: str, port: int) -> list[str]:
    """The host_maddrs to listen on for --host HOST --port PORT (port 0: any free port)."""
    ip = ipaddress.ip_address(host_ip(host))
    if isinstance(port, bool) or not 0 <= port <= 65535:
        raise AddressError(f"--port must be between 0 and 65535, got {port}")
    return [f"/ip{ip.version}/{ip.compressed}/tcp/{port}"]


def peer_id_of(maddr: Multiaddr) -> str:
    """The peer id of the final /p2p part (for a relayed address: the target, not the relay)."""
    items = list(maddr.items())
    if not items or items[-1][0].name != "p2p":
        raise AddressError(f"'{maddr}' does not end with /p2p/<peer id>")
    return str(items[-1][1])


def without_peer_id(maddr: Multiaddr) -> Multiaddr:
    """The address without its final /p2p/<peer id> part (unchanged if it has none)."""
    if _names(maddr)[-1] != "p2p":
        return maddr
    return maddr.decapsulate(Multiaddr(f"/p2p/{peer_id_of(maddr)}"))


def join_hint(maddrs: list[str], extra_args: list[str]) -> str:
    """A shell command another machine can paste to join through the given full addresses,
    those it can reach first (a loopback address serves only this machine's nodes)."""
    if not maddrs:
        raise AddressError("there is no address to put in the join command")
    reachable_first = sorted(maddrs, key=is_loopback)
    return shlex.join(["diloco-node", "join", "--peers", *reachable_first, *extra_args])


def is_loopback(maddr: str) -> bool:
    """Whether the address is /ip4/127.x or /ip6/::1 (or /dns*/localhost)."""
    parts = maddr.split("/")
    if len(parts) < 3:
        return False
    if parts[1] in ("dns", "dns4", "dns6"):
        return parts[2].lower() == LOCALHOST
    try:
        return parts[1] in ("ip4", "ip6") and ipaddress.ip_address(parts[2]).is_loopback
    except ValueError:
        return False


def _parse_dialable(text: str, *, flag: str) -> Multiaddr:
    stripped = text.strip()
    try:
        maddr = Multiaddr(stripped)
    except (MultiaddrError, ValueError, TypeError) as exc:
        reason = getattr(exc, "message", None) or str(exc)
        raise AddressError(f"{flag}: '{text}' is not a valid multiaddr ({reason})") from None
    port = _transport_port(maddr)
    if port is None:
        raise AddressError(f"{flag}: '{text}' has no address to dial; expected {_EXPECTED}")
    if port == 0:
        raise AddressError(f"{flag}: '{text}' has port 0, which cannot be dialled")
    return maddr


def _transport_port(maddr: Multiaddr) -> int | None:
    """The port of a leading /<network>/HOST/tcp|udp/PORT[/quic], or None if there is none."""
    items = list(maddr.items())
    names = [proto.name for proto, _ in items]
    if len(names) < 2 or names[0] not in NETWORKS:
        return None
    if names[1] == "tcp" or (names[1] == "udp" and len(names) > 2 and names[2] in QUIC):
        return int(items[1][1])
    return None


def _names(maddr: Multiaddr) -> list[str]:
    return [proto.name for proto in maddr.protocols()] or [""]
