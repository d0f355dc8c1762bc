"""What a joining node tells its user about how the world reaches it: the doctor's facts
(reachability, relay, announced addresses) in the node's first lines and whenever they change,
and which bootstrap address failed and why when none could be reached.

Pure: built from this node's own addresses and its flags, and from `dht.doctor`'s probes. A
running node does not read AutoNAT's verdict (only `diloco-node doctor` waits for it), so a
public address it has not been told to announce is reported as unconfirmed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

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


def reachability(own: Iterable[str], *, announce_given: bool, use_auto_relay: bool) -> Reachability:
    """How peers reach a node with addresses `own` (p2pd's, relayed ones included)."""
    announced = [m for m in own if not m.startswith(("/ip4/127.", "/ip6/::1/"))]
    relays = sorted({r for r in map(relay_of, announced) if r})
    public = [m for m in announced if is_public_maddr(m)]
    if announce_given:
        line = "public (--announce): peers dial this node directly"
    elif relays:
        line = f"behind a NAT, reachable through relay {', '.join(relays)}"
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


class ReachabilityNotes:
    """The verdicts worth telling: the first one, then each change (a relay slot taken or
    lost), not the same one every heartbeat."""

    def __init__(self, *, announce_given: bool, use_auto_relay: bool) -> None:
        self._flags = {"announce_given": announce_given, "use_auto_relay": use_auto_relay}
        self._told: str | None = None

    def first(self, own: Iterable[str]) -> Reachability:
        found = reachability(own, **self._flags)
        self._told = found.line
        return found

    def update(self, own: Iterable[str]) -> Reachability | None:
        """The verdict when it differs from the last one told, else None."""
        found = reachability(own, **self._flags)
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
