"""How peers behind NAT reach each other: relay limits, p2pd's relay flags, and which path each
connection took (direct, hole-punched, relayed).

p2pd (hivemind's go-libp2p daemon) relays for others with circuit relay v2 and upgrades a
relayed connection to a direct one by DCUtR hole punching (on with AutoNAT). Two of its defaults
defeat a small swarm, and this module sets them:

- With relay discovery on (its default), autorelay wants 4 relay candidates and otherwise waits
  its boot delay (3 minutes) before reserving a slot; a swarm with one public node never gets a
  relayed address in time. The node's bootstrap peers are given as static (trusted) relays and
  discovery is turned off, so a NAT'd node reserves a slot with them as soon as AutoNAT calls it
  private (about 15 s).
- A node reachable at a public address that AutoNAT cannot yet confirm (no peer to dial it back)
  does not serve as a relay; a node told its public address (--announce) is forced public.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # hivemind is slow to import; `--help` reads RelayLimits
    from hivemind.p2p import P2P

PathKind = Literal["direct", "holepunched", "relayed"]
PATH_KINDS: tuple[PathKind, ...] = ("direct", "holepunched", "relayed")
CIRCUIT = "/p2p-circuit"


@dataclass(frozen=True, kw_only=True)
class RelayLimits:
    """What this node spends relaying for peers behind NAT (p2pd's relay service).

    Passed to p2pd; they serve on a node told it is public (daemon_env says how). Elsewhere
    hivemind 1.1.12's p2pd serves circuits with a second relay service of go-libp2p's defaults
    (128 KiB, 2 minutes: dht.resumable) until AutoNAT confirms the node public."""

    max_circuits: int = 16
    """Relayed connections open at once per peer."""
    max_bytes: int = 1 << 30
    """Bytes one relayed connection carries (each direction) before it is reset."""
    max_duration_s: float = 1200.0
    """Seconds one relayed connection lives before it is reset (a new one is dialled)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_circuits <= 1024:
            raise ValueError(f"--relay-max-circuits must be in 1..1024, got {self.max_circuits}")
        if not 1 << 16 <= self.max_bytes <= 1 << 40:
            raise ValueError("--relay-max-mb must be between 0.066 and 1099511 MB")
        if not 10.0 <= self.max_duration_s <= 86400.0:
            raise ValueError(
                f"--relay-max-duration must be 10 to 86400 seconds, got {self.max_duration_s}"
            )

    def daemon_flags(self) -> dict[str, str]:
        return {
            "relayMaxCircuits": str(self.max_circuits),
            "relayDataLimit": str(self.max_bytes),
            "relayTimeLimit": f"{self.max_duration_s:.0f}s",
        }


def daemon_env(*, force_public: bool) -> dict[str, str]:
    """p2pd's environment beyond hivemind's: one Go scheduler thread for a node told it is
    public, so that the relay service its `-relay*` flags configure is the one that serves.

    hivemind 1.1.12's p2pd starts two circuit relay v2 services on the same protocol: the
    configured one (go-libp2p's relay manager starts it, in a goroutine, on the reachability
    event a forced-public node emits while the host is built) and, after the host is built,
    one with go-libp2p's defaults (`EnableRelayV2`: 128 KiB and 2 minutes per relayed
    connection); whichever registers last serves every circuit. With Go's default scheduler
    the default one won 5 of 6 starts; with GOMAXPROCS=1 the configured one won 4 of 4
    (bench.relay_race, docs/nat.md "Session 14"). An order Go does not promise, measured
    here, not proven: a relayed transfer still resumes across cuts (dht.resumable)."""
    return {"GOMAXPROCS": "1"} if force_public else {}


def daemon_flags(
    *, use_auto_relay: bool, initial_peers: Iterable[str], limits: RelayLimits
) -> dict[str, str]:
    """p2pd flags hivemind.P2P.create does not expose: relay limits, and static relays (the
    bootstrap peers, passed as trusted_relays) without discovery when there are any."""
    flags = limits.daemon_flags()
    if use_auto_relay and list(initial_peers):
        flags["relayDiscovery"] = "0"
    return flags


def tuned_p2p(flags: Mapping[str, str], env: Mapping[str, str] | None = None) -> type[P2P]:
    """hivemind's P2P, starting p2pd with `flags` added to those P2P.create passes, and with
    `env` in its environment (`env NAME=VALUE p2pd ...`: the same pid, p2pd's alone)."""
    from hivemind.p2p import P2P

    extra = dict(flags)
    prefix = ["env", *(f"{k}={v}" for k, v in (env or {}).items())] if env else []

    class TunedP2P(P2P):
        # hivemind's private hook, kept: P2P.create builds p2pd's command line here and has
        # no public parameter for extra daemon flags (relay limits, relay discovery).
        def _make_process_args(self, *args: Any, **kwargs: Any) -> list[str]:  # type: ignore[override]
            return prefix + P2P._make_process_args(*args, **{**kwargs, **extra})

    return TunedP2P


def is_relayed(maddr: str) -> bool:
    return CIRCUIT in maddr


def is_public(maddr: str) -> bool:
    """Whether `maddr` (/ip4/A/... or /ip6/A/...) is a globally routable address: not a LAN,
    loopback, link-local or shared (100.64/10) one."""
    parts = maddr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        return False
    try:
        return ipaddress.ip_address(parts[2]).is_global
    except ValueError:
        return False


def relay_of(maddr: str) -> str | None:
    """The relay's peer id in a /.../p2p/RELAY/p2p-circuit[/p2p/TARGET] address."""
    if not is_relayed(maddr):
        return None
    before = maddr.split(CIRCUIT, 1)[0]
    return before.rsplit("/p2p/", 1)[-1] if "/p2p/" in before else None


def connections_by_peer(entries: Iterable[tuple[str, Iterable[str]]]) -> dict[str, list[str]]:
    """Peer id -> the remote addresses of all its connections, from p2pd's list_peers entries.

    p2pd lists one entry per connection, so a peer that holds a relayed and a direct
    connection appears twice; a dictionary built entry by entry would keep only the last."""
    found: dict[str, list[str]] = {}
    for peer, addrs in entries:
        found.setdefault(peer, []).extend(addrs)
    return found


def shareable(maddrs: Iterable[str], limit: int) -> list[str]:
    """At most `limit` of this node's addresses for its heartbeat, the ones a peer elsewhere can
    use first: relayed and other addresses before loopback ones (a heartbeat holds 16; a relay
    slot adds an address per relay, and a machine with many interfaces has many)."""
    found = list(maddrs)
    loopback = [m for m in found if m.startswith(("/ip4/127.", "/ip6/::1/"))]
    relayed = [m for m in found if is_relayed(m)]
    others = [m for m in found if m not in loopback and m not in relayed]
    return (relayed + others + loopback)[:limit]


def path_rank(kind: PathKind | None) -> int:
    """How promising a peer is to open a stream to, by this node's connection to it now (lower
    first): a direct or hole-punched connection carries a stream at once; a relayed one proves
    the relay still holds the peer's slot; with no connection, the dial may find no route, or a
    relay without a slot for it (`NO_RESERVATION`)."""
    return {"direct": 0, "holepunched": 0, "relayed": 1}.get(kind or "", 2)


def paths_label(counts: Mapping[str, int]) -> str:
    """`1 direct, 2 relayed` (kinds with no peer left out); `-` when nothing was measured."""
    found = [f"{counts[kind]} {kind}" for kind in PATH_KINDS if counts.get(kind)]
    return ", ".join(found) if found else "-"


class PathBook:
    """Which path each connected peer is on now, from the addresses of its connections.

    A peer on a direct connection to a public address that was earlier seen only through a
    relay, or that holds a relayed connection beside it, got there by hole punching: a NAT'd
    peer accepts no other direct connection from outside. So did one that announces a relayed
    address (it is behind a NAT) while this node is behind a NAT too (`nat_peers`): neither
    could have dialled the other. A punch can be faster than the first observation, and the
    relayed connection gone by then: two homes punched 15 s after they started and every
    fetch was counted "direct" (tests/swarm/test_nat.py's punch test, session 16). A direct
    connection on a LAN address is direct, whatever came before (two homes behind one router).
    """

    def __init__(self) -> None:
        self._was_relayed: set[str] = set()
        self._paths: dict[str, PathKind] = {}

    def observe(
        self, connections: Mapping[str, Iterable[str]], nat_peers: Collection[str] = ()
    ) -> None:
        """Peer id -> addresses of its open connections (p2pd's list_peers), all peers;
        `nat_peers`: peers known to be behind a NAT while this node is behind one too."""
        paths: dict[str, PathKind] = {}
        for peer, addrs in connections.items():
            addrs = list(addrs)
            if not addrs:
                continue
            relayed = any(is_relayed(a) for a in addrs)
            if relayed:
                self._was_relayed.add(peer)
            direct = [a for a in addrs if not is_relayed(a)]
            if not direct:
                paths[peer] = "relayed"
            elif (peer in self._was_relayed or peer in nat_peers) and any(map(is_public, direct)):
                paths[peer] = "holepunched"
            else:
                paths[peer] = "direct"
        self._paths = paths

    def current(self) -> dict[str, PathKind]:
        """Connected peer id -> its path, as last observed."""
        return dict(self._paths)

    def path(self, peer: str) -> PathKind | None:
        return self._paths.get(peer)

    def counts(self) -> dict[PathKind, int]:
        """Connected peers per path, every kind present (0 when none)."""
        found = Counter(self._paths.values())
        return {kind: found.get(kind, 0) for kind in PATH_KINDS}
