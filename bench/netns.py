"""Network namespaces for the chaos harness: one per node, bridged, so a node's link can be cut.

Layout: a hub namespace holding a bridge, and per node a namespace whose veth's other end is
on that bridge. Nodes get addresses in 100.64.0.0/24 (shared address space, RFC 6598), which
exist only inside these namespaces. libp2p's DHT keeps such addresses (it treats them as
private) but drops special ranges such as 198.18.0.0/15, and then peers cannot find each
other. Cutting a node sets its link down: its connections stall exactly as if its cable were
pulled, and come back when the link is set up again. Needs root and iproute2; `available()`
says whether this machine allows it.

A node's link can also be slowed: `limit(node, mbit)` puts a token-bucket filter (`tc qdisc
... tbf`) on both ends of its veth, so what it sends and what it receives each pass at that
rate, like a volunteer's access line. `measure_mbit(src, dst)` times a real TCP transfer
between two namespaces (`python -m bench.netns receive|send`), to check the limit bites.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
"""Where `python -m bench.netns` runs from (the probe's two ends)."""

SUBNET = "100.64.0"
"""First three octets of the node addresses (/24 inside the namespaces only)."""
BRIDGE_HOST = 254
"""Last octet of the bridge's own address (nodes use 1 to 250)."""
PROBE_PORT = 5201
"""TCP port of `measure_mbit`'s receiver inside the destination namespace."""
PROBE_TIMEOUT_S = 120.0
"""Bound on one probe transfer (1 MB at 0.1 Mbit/s would take 80 s)."""
TBF_LATENCY_MS = 200
"""Longest a packet may wait in a limited link's queue (tbf's queue size, as a time)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=10)


def _tc(*args: str) -> None:
    result = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=10)
    if result.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} failed: {result.stderr.strip()}")


def _tbf_sent_bytes(netns_args: list[str], dev: str) -> int:
    result = subprocess.run(
        ["tc", *netns_args, "-s", "qdisc", "show", "dev", dev],
        capture_output=True,
        text=True,
        timeout=10,
    )
    found = re.search(r"qdisc tbf .*?Sent (\d+) bytes", result.stdout, re.DOTALL)
    return int(found.group(1)) if found else 0


def tbf_burst_bytes(mbit: float) -> int:
    """Token bucket size: 10 ms of the rate, at least 16 KiB (tbf needs a bucket larger than
    one timer tick's worth of bytes, else it cannot reach its rate)."""
    return max(16 * 1024, int(mbit * 1e6 / 8 / 100))


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
        self._bridge_addressed = False

    def namespace(self, node: int) -> str:
        return f"{self._tag}-n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def exec_prefix(self, node: int) -> list[str]:
        """Prepend to a command line to run it inside `node`'s namespace."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def bridge_address(self) -> str:
        """An address on the bridge itself, in the hub namespace (given on first use): a
        process there (run with hub_prefix()) reaches every node without using a node's link
        to the others, e.g. a bootstrap peer."""
        address = f"{SUBNET}.{BRIDGE_HOST}"
        if not self._bridge_addressed:
            _ip("-n", self.hub, "addr", "add", f"{address}/24", "dev", "br0")
            self._bridge_addressed = True
        return address

    def hub_prefix(self) -> list[str]:
        """Prepend to a command line to run it in the hub namespace."""
        return ["ip", "netns", "exec", self.hub]

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

    def limit(self, node: int, mbit: float) -> None:
        """Slow `node`'s link to `mbit` Mbit/s each way: a tbf on its veth (what it sends)
        and on its bridge port (what it receives)."""
        if not 0 < mbit <= 100_000:
            raise ValueError(f"a link rate must be in (0, 100000] Mbit/s, got {mbit}")
        shape = ["root", "tbf", "rate", f"{mbit * 1000:.0f}kbit"]
        shape += ["burst", str(tbf_burst_bytes(mbit)), "latency", f"{TBF_LATENCY_MS}ms"]
        _tc("-n", self.namespace(node), "qdisc", "replace", "dev", f"v{node}", *shape)
        _tc("-n", self.hub, "qdisc", "replace", "dev", f"h{node}", *shape)

    def qdiscs(self, node: int) -> str:
        """`tc qdisc show` of `node`'s veth (what limits what it sends)."""
        result = subprocess.run(
            ["tc", "-n", self.namespace(node), "qdisc", "show", "dev", f"v{node}"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return result.stdout.strip()

    def link_bytes(self, node: int) -> tuple[int, int]:
        """(sent, received) bytes that passed `node`'s limits since `limit()`: what tbf let
        onto the wire, IP and TCP headers included (0, 0 on an unlimited link)."""
        sent = _tbf_sent_bytes(["-n", self.namespace(node)], f"v{node}")
        return sent, _tbf_sent_bytes(["-n", self.hub], f"h{node}")

    def measure_mbit(self, src: int, dst: int, num_bytes: int = 1_000_000) -> float:
        """Mbit/s of one real TCP transfer of `num_bytes` from `src`'s namespace to `dst`'s,
        timed by the receiver from its first byte to the end."""
        receiver = subprocess.Popen(
            [*self.exec_prefix(dst), sys.executable, "-m", "bench.netns", "receive"]
            + [self.address(dst), str(PROBE_PORT)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )
        try:
            sender = [*self.exec_prefix(src), sys.executable, "-m", "bench.netns", "send"]
            sender += [self.address(dst), str(PROBE_PORT), str(num_bytes)]
            subprocess.run(
                sender, check=True, capture_output=True, timeout=PROBE_TIMEOUT_S, cwd=REPO
            )
            out, err = receiver.communicate(timeout=PROBE_TIMEOUT_S)
        finally:
            receiver.kill()
            receiver.wait()
        if receiver.returncode != 0:
            raise RuntimeError(f"probe receiver failed: {err.strip()[-500:]}")
        figures = json.loads(out)
        return float(figures["num_bytes"] * 8 / figures["seconds"] / 1e6)

    def close(self) -> None:
        for name in reversed(self._made):
            result = _ip("netns", "del", name, check=False)
            if result.returncode != 0:
                logger.warning("could not delete namespace %s: %s", name, result.stderr.strip())
        self._made.clear()


def receive(host: str, port: int, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, float]:
    """Accept one connection, read it to its end; bytes and seconds from the first byte."""
    with socket.create_server((host, port), reuse_port=True) as server:
        server.settimeout(timeout_s)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout_s)
            num_bytes, first = 0, None
            while chunk := conn.recv(1 << 16):
                first = first or time.perf_counter()
                num_bytes += len(chunk)
    seconds = time.perf_counter() - first if first else 0.0
    return {"num_bytes": num_bytes, "seconds": seconds}


def send(host: str, port: int, num_bytes: int, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Connect to a `receive`r (retrying while it starts) and send `num_bytes` zero bytes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=timeout_s)
            break
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        conn.sendall(bytes(num_bytes))


def main() -> None:
    parser = argparse.ArgumentParser(description="Link probe: one timed TCP transfer.")
    parser.add_argument("role", choices=("receive", "send"))
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("num_bytes", type=int, nargs="?", default=0)
    args = parser.parse_args()
    if args.role == "receive":
        print(json.dumps(receive(args.host, args.port)))
    else:
        send(args.host, args.port, args.num_bytes)


if __name__ == "__main__":
    main()
