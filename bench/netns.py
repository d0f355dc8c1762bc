"""Network namespaces for the chaos harness: one per node, bridged, so a node's link can be cut.

Layout: a hub namespace holding a bridge, and per node a namespace whose veth's other end is
on that bridge. Nodes get addresses in 100.64.0.0/24 (shared address space, RFC 6598), which
exist only inside these namespaces. libp2p's DHT keeps such addresses (it treats them as
private) but drops special ranges such as 198.18.0.0/15, and then peers cannot find each
other. Cutting a node sets its link down: its connections stall exactly as if its cable were
pulled, and come back when the link is set up again. Needs root and iproute2; `available()`
says whether this machine allows it.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

logger = logging.getLogger(__name__)

SUBNET = "100.64.0"
"""First three octets of the node addresses (/24 inside the namespaces only)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def available() -> bool:
    """Whether network namespaces can be made here (root, iproute2, the kernel allows it)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"dlc-probe-{os.getpid()}"
    try:
        made = _ip("netns", "add", name, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
    if made:
        _ip("netns", "del", name, check=False)
    return made


class NetnsLab:
    """A bridged namespace per node; use as a context manager so every namespace is deleted."""

    def __init__(self, num_nodes: int) -> None:
        if not 1 <= num_nodes <= 250:
            raise ValueError("the namespace lab holds 1 to 250 nodes")
        self.num_nodes = num_nodes
        self._tag = f"dlc{os.getpid()}"
        self.hub = f"{self._tag}-hub"
        self._made: list[str] = []

    def namespace(self, node: int) -> str:
        return f"{self._tag}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def exec_prefix(self, node: int) -> list[str]:
        """Prepend to a command line to run it inside `node`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def __enter__(self) -> NetnsLab:
        try:
            self._add(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for node in range(self.num_nodes):
                self._add_node(node)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)

    def _add_node(self, node: int) -> None:
        ns, veth, port = self.namespace(node), f"v{node}", f"h{node}"
        self._add(ns)
        _ip(
            "link",
            "add",
            veth,
            "netns",
            ns,
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            self.hub,
        )
        _ip("-n", ns, "addr", "add", f"{self.address(node)}/24", "dev", veth)
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "set", veth, "up")
        _ip("-n", self.hub, "link", "set", port, "master", "br0")
        _ip("-n", self.hub, "link", "set", port, "up")

    def cut(self, node: int) -> None:
        """Pull `node`'s cable: its link goes down, its connections stall."""
        _ip("-n", self.hub, "link", "set", f"h{node}", "down")

    def restore(self, node: int) -> None:
        _ip("-n", self.hub, "link", "set", f"h{node}", "up")

    def close(self) -> None:
        for name in reversed(self._made):
            result = _ip("netns", "del", name, check=False)
            if result.returncode != 0:
                logger.warning("could not delete namespace %s: %s", name, result.stderr.strip())
        self._made.clear()
