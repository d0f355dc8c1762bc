"""What a joining node tells its user about how the world reaches it: the doctor's facts
(reachability, relay, announced addresses) in the node's first lines and whenever they change,
and which bootstrap address failed and why when none could be reached.

Pure: built from this node's own addresses, its flags and the IPs of its own interfaces,
and from `dht.doctor`'s probes. A running node does not read AutoNAT's verdict (only
`diloco-node doctor` waits for it), so a public address it has not been told to announce is
reported as unconfirmed. A public address on none of its interfaces is one peers observed
(identify, once 4 peers of distinct IPs saw it): its router's, so the node is behind a NAT
(with 4 public peers a home's first line said "a public address (the router's)" 15 s before
it said "behind a NAT, reachable through relay ...").
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import psutil

from dht.doctor import BootstrapProbe, is_public_maddr
from dht.reachability import relay_of


@dataclass(frozen=True, kw_only=True)
class Reachability:
    """One verdict: a line for the console, and the facts behind it."""

    line: str
    announced: list[str] = field(default_factory=list)
    """This node's addresses other machines could use (loopback left out)."""
    relays: list[str] = field(default_factory=list)
    """Peer ids of the relays holding a slot for this node."""


def reachability(
    own: Iterable[str],
    *,
    announce_given: bool,
    use_auto_relay: bool,
    local_ips: Collection[str] | None = None,
) -> Reachability:
    """How peers reach a node with addresses `own` (p2pd's, relayed ones included);
    `local_ips`: the IPs of its interfaces (None: unknown, every public address may be its
    own)."""
    announced = [m for m in own if not m.startswith(("/ip4/127.", "/ip6/::1/"))]
    relays = sorted({r for r in map(relay_of, announced) if r})
    public = [m for m in announced if is_public_maddr(m)]
    observed = [m for m in public if local_ips is not None and ip_of(m) not in local_ips]
    if announce_given:
        line = "public (--announce): peers dial this node directly"
    elif relays:
        line = f"behind a NAT, reachable through relay {', '.join(relays)}"
    elif public and len(observed) == len(public):
        line = f"behind a NAT (peers see it at {observed[0]}, its router's address); " + (
            "waiting for a relay slot (about 15 s after joining)"
            if use_auto_relay
            else "peers outside may not reach it (--auto-relay with a public node in --peers; "
            "see `diloco-node doctor`)"
        )
    elif public:
        line = (
            f"a public address ({public[0]}), not confirmed: "
            "`diloco-node doctor` checks that peers can dial it"
        )
    elif use_auto_relay:
        line = "no public address; waiting for a relay slot (about 15 s after joining)"
    else:
        line = (
            "local addresses only: machines outside this network cannot reach it "
            "(--auto-relay with a public node in --peers, or --announce; see "
            "`diloco-node doctor`)"
        )
    return Reachability(line=line, announced=announced, relays=relays)


def ip_of(maddr: str) -> str:
    """The IP of an /ip4/ or /ip6/ multiaddr ("" for any other)."""
    parts = maddr.split("/")
    return parts[2] if len(parts) > 2 and parts[1] in ("ip4", "ip6") else ""


def interface_ips() -> set[str]:
    """The IPs of this machine's interfaces (its network namespace's)."""
    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}


class ReachabilityNotes:
    """The verdicts worth telling: the first one, then each change (a relay slot taken or
    lost), not the same one every heartbeat."""

    def __init__(
        self,
        *,
        announce_given: bool,
        use_auto_relay: bool,
        local_ips: Collection[str] | None = None,
    ) -> None:
        """`local_ips`: this machine's interface IPs (None: read them now)."""
        self._announce_given = announce_given
        self._use_auto_relay = use_auto_relay
        self._local_ips = interface_ips() if local_ips is None else set(local_ips)
        self._told: str | None = None

    def _verdict(self, own: Iterable[str]) -> Reachability:
        return reachability(
            own,
            announce_given=self._announce_given,
            use_auto_relay=self._use_auto_relay,
            local_ips=self._local_ips,
        )

    def first(self, own: Iterable[str]) -> Reachability:
        found = self._verdict(own)
        self._told = found.line
        return found

    def update(self, own: Iterable[str]) -> Reachability | None:
        """The verdict when it differs from the last one told, else None."""
        found = self._verdict(own)
        if found.line == self._told:
            return None
        self._told = found.line
        return found


def bootstrap_failure(probes: list[BootstrapProbe]) -> str:
    """One sentence naming each bootstrap address that failed and why."""
    failed = [p for p in probes if p.outcome != "ok"]
    if not failed:
        return "the bootstrap peers answered a probe but p2pd could not connect to them"
    reasons = "; ".join(
        f"{p.maddr}: {p.outcome}" + (f" ({p.detail})" if p.detail else "") for p in failed
    )
    return f"could not connect to a bootstrap peer: {reasons}"
