"""A NAT test bed in network namespaces: a public internet, home routers, homes behind them.

Layout (TAG is unique per run: `dlcnat<pid>`):

    TAG-wan    the internet: a bridge, WAN_SUBNET.0/24, nothing else
    TAG-pub<i> a public machine on the bridge (WAN_SUBNET.10+i): bootstrap, relay
    TAG-r<r>   home router r: `wan` on the bridge (WAN_SUBNET.100+r), a `lan` bridge
               (192.168.r+1.1/24), IPv4 forwarding, nftables NAT:
               cone: `masquerade` (the source port is kept when free: hole punching works)
               symmetric: `masquerade random,fully-random` (a new port per connection)
               and a forward filter that lets the WAN in only for established flows
    TAG-h<r>-<j> home machine j behind router r (192.168.r+1.10+j), default route via r

A home's access line is asymmetric: tbf on the router's `wan` (what the home uploads) and on
the bridge port it hangs from (what the home downloads).

The WAN range is public to libp2p (AutoNAT and hole punching consider public addresses only)
and exists only inside these namespaces: nothing is routed out of them.

Teardown: `close()` (context manager) deletes every namespace and kills what runs in it. A
watchdog process (`python -m bench.nat watch PID TAG`) does the same when the bench's process
dies, kill -9 included, and every new lab first reaps namespaces of runs whose process is gone.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from bench.netns import available, tbf_burst_bytes

logger = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
WAN_SUBNET = "11.64.0"
"""First three octets of the internet's addresses (public to libp2p, unrouted here)."""
TAG_PREFIX = "dlcnat"
TAG_PATTERN = re.compile(rf"^{TAG_PREFIX}(\d+)-")
NAT_KINDS = ("cone", "symmetric")
TBF_LATENCY_MS = 200
WATCH_POLL_S = 0.5


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=15)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check=check)


def missing() -> str | None:
    """Why this machine cannot build the bed (one line), or None when it can."""
    if os.geteuid() != 0:
        return "the NAT test bed needs root (network namespaces)"
    for tool in ("ip", "tc", "nft"):
        if shutil.which(tool) is None:
            hint = " (apt-get install -y nftables)" if tool == "nft" else ""
            return f"the NAT test bed needs `{tool}`{hint}"
    return None if available() else "this kernel refuses new network namespaces"


def nft_rules(kind: str) -> str:
    """The router's nftables ruleset for a NAT of `kind` (cone or symmetric)."""
    if kind not in NAT_KINDS:
        raise ValueError(f"a NAT is one of {', '.join(NAT_KINDS)}, got {kind!r}")
    masquerade = "masquerade" if kind == "cone" else "masquerade random,fully-random"
    return f"""
table ip nat {{
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "wan" {masquerade}
  }}
}}
table ip filter {{
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    iifname "lan" oifname "wan" accept
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "wan" ct state new drop
  }}
}}
"""


@dataclass(frozen=True)
class Home:
    """A home network: its NAT and how many machines sit behind it."""

    nat: str
    num_hosts: int = 1


class NatLab:
    """The bed; a context manager, so every namespace goes whatever happens."""

    def __init__(
        self,
        *,
        num_public: int = 1,
        homes: tuple[Home, ...] = (Home("cone"), Home("symmetric")),
        down_mbit: float | None = 20.0,
        up_mbit: float | None = 5.0,
        watchdog: bool = True,
    ) -> None:
        if not 1 <= num_public <= 80 or not 1 <= len(homes) <= 100:
            raise ValueError("the NAT bed holds 1 to 80 public machines and 1 to 100 homes")
        for home in homes:
            nft_rules(home.nat)
            if not 1 <= home.num_hosts <= 200:
                raise ValueError("a home holds 1 to 200 machines")
        self.num_public, self.homes = num_public, homes
        self.down_mbit, self.up_mbit = down_mbit, up_mbit
        self.tag = f"{TAG_PREFIX}{os.getpid()}"
        self._made: list[str] = []
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._want_watchdog = watchdog

    # ---- names and addresses ----------------------------------------------------------------

    @property
    def wan(self) -> str:
        return f"{self.tag}-wan"

    def public(self, i: int) -> str:
        return f"{self.tag}-pub{i}"

    def router(self, r: int) -> str:
        return f"{self.tag}-r{r}"

    def host(self, r: int, j: int = 0) -> str:
        return f"{self.tag}-h{r}-{j}"

    def public_address(self, i: int) -> str:
        return f"{WAN_SUBNET}.{10 + i}"

    def router_address(self, r: int) -> str:
        return f"{WAN_SUBNET}.{100 + r}"

    def host_address(self, r: int, j: int = 0) -> str:
        return f"192.168.{r + 1}.{10 + j}"

    @staticmethod
    def prefix(namespace: str) -> list[str]:
        """Prepend to a command line to run it in `namespace`."""
        return ["ip", "netns", "exec", namespace]

    # ---- build and tear down ----------------------------------------------------------------

    def __enter__(self) -> NatLab:
        reap_stale()
        if self._want_watchdog:
            self._watchdog = _start_watchdog(self.tag)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        self._add(self.wan)
        _ip("-n", self.wan, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.wan, "link", "set", "br0", "up")
        for i in range(self.num_public):
            self._add(self.public(i))
            self._plug(self.public(i), "eth0", self.wan, f"p{i}", "br0")
            self._address(self.public(i), "eth0", f"{self.public_address(i)}/24")
        for r, home in enumerate(self.homes):
            self._build_home(r, home)

    def _build_home(self, r: int, home: Home) -> None:
        router = self.router(r)
        self._add(router)
        self._plug(router, "wan", self.wan, f"r{r}", "br0")
        self._address(router, "wan", f"{self.router_address(r)}/24")
        _ip("-n", router, "link", "add", "lan", "type", "bridge")
        self._address(router, "lan", f"192.168.{r + 1}.1/24")
        _run([*self.prefix(router), "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        result = subprocess.run(
            [*self.prefix(router), "nft", "-f", "-"],
            input=nft_rules(home.nat),
            capture_output=True,
            text=True,
            timeout=15,
        )
        if result.returncode != 0:
            raise RuntimeError(f"nft refused the {home.nat} NAT: {result.stderr.strip()}")
        if self.up_mbit is not None:
            _shape(["-n", router], "wan", self.up_mbit)
        if self.down_mbit is not None:
            _shape(["-n", self.wan], f"r{r}", self.down_mbit)
        for j in range(home.num_hosts):
            host = self.host(r, j)
            self._add(host)
            self._plug(host, "eth0", router, f"l{j}", "lan")
            self._address(host, "eth0", f"{self.host_address(r, j)}/24")
            _ip("-n", host, "route", "add", "default", "via", f"192.168.{r + 1}.1")

    def _add(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    @staticmethod
    def _plug(ns: str, dev: str, other: str, port: str, bridge: str) -> None:
        """A veth from `ns` (named `dev`) to `other`'s `bridge` (named `port`), both up."""
        _ip("link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", other)
        _ip("-n", other, "link", "set", port, "master", bridge)
        _ip("-n", other, "link", "set", port, "up")
        _ip("-n", other, "link", "set", bridge, "up")
        _ip("-n", ns, "link", "set", dev, "up")

    @staticmethod
    def _address(ns: str, dev: str, cidr: str) -> None:
        _ip("-n", ns, "addr", "add", cidr, "dev", dev)
        _ip("-n", ns, "link", "set", dev, "up")

    def cut_public(self, i: int) -> None:
        """Pull public machine i's cable (its connections stall, as when it dies)."""
        _ip("-n", self.wan, "link", "set", f"p{i}", "down")

    def close(self) -> None:
        delete_namespaces(reversed(self._made))
        self._made.clear()
        if self._watchdog is not None:
            self._watchdog.kill()
            self._watchdog.wait()
            self._watchdog = None


def _shape(netns_args: list[str], dev: str, mbit: float) -> None:
    shape = ["root", "tbf", "rate", f"{mbit * 1000:.0f}kbit", "burst", str(tbf_burst_bytes(mbit))]
    shape += ["latency", f"{TBF_LATENCY_MS}ms"]
    _run(["tc", *netns_args, "qdisc", "replace", "dev", dev, *shape])


def delete_namespaces(names: Iterable[str]) -> None:
    """Kill every process in each namespace, then delete it (a namespace with processes in
    it would live on, nameless, after its deletion)."""
    for name in names:
        pids = _ip("netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        result = _ip("netns", "del", name, check=False)
        if result.returncode != 0:
            logger.warning("could not delete namespace %s: %s", name, result.stderr.strip())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces(tag: str | None = None) -> list[str]:
    """This bed's namespaces (all runs', or one run's `tag`)."""
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    names = [line.split()[0] for line in listed if line.strip()]
    return [n for n in names if TAG_PATTERN.match(n) and (tag is None or n.startswith(f"{tag}-"))]


def reap_stale() -> list[str]:
    """Delete the namespaces of runs whose process is gone; the names deleted."""
    stale = [n for n in namespaces() if not _alive(_builder_pid(n))]
    delete_namespaces(stale)
    return stale


def _builder_pid(namespace: str) -> int:
    found = TAG_PATTERN.match(namespace)
    assert found is not None, namespace  # namespaces() keeps only matching names
    return int(found.group(1))


def _start_watchdog(tag: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.nat", "watch", str(os.getpid()), tag],
        cwd=REPO,
        start_new_session=True,  # outlives a kill of the bench's process group
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


def watch(pid: int, tag: str) -> None:
    """Wait for process `pid` to die, then delete the namespaces of `tag`."""
    while _alive(pid):
        time.sleep(WATCH_POLL_S)
    delete_namespaces(namespaces(tag))


def main() -> None:
    parser = argparse.ArgumentParser(description="NAT test bed housekeeping.")
    commands = parser.add_subparsers(dest="command", required=True)
    watch_cmd = commands.add_parser("watch", help="delete a run's namespaces when it dies")
    watch_cmd.add_argument("pid", type=int)
    watch_cmd.add_argument("tag")
    commands.add_parser("reap", help="delete the namespaces of dead runs")
    args = parser.parse_args()
    if args.command == "watch":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        watch(args.pid, args.tag)
    else:
        print("\n".join(reap_stale()))


if __name__ == "__main__":
    main()
