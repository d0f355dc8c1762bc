"""Does p2pd punch a hole between two homes of bench.nat's bed? (DCUtR, measured, not assumed)

    PYTHONPATH=$PWD python -m bench.punch_probe --observers 4 --nats cone,cone [--quic]

go-libp2p 0.32 (hivemind 1.1.12's p2pd) starts a hole punch only once identify has confirmed a
public observed address of the host, seen by `ActivationThresh` = 4 peers of distinct IPs
over direct connections (identify/obsaddr.go), and only from the side that received the
relayed connection (holepunch/svc.go: a notifiee on inbound relayed connections). The bed
therefore gets a relay (public machine 0) and `--observers` more public p2pd's; each home
connects directly to all of them, reserves a slot with the relay, and home 0 dials home 1
through it. The final JSON line says whether and when a direct connection between the homes
appeared, and carries both homes' p2p-holepunch log lines (p2pd's own, at debug level).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PORT = 4100
GOLOG = "error,p2p-holepunch=debug,autonat=info,autorelay=info"


def _say(**fields: Any) -> None:
    print(json.dumps({"event": "probe", **fields}), flush=True)


def _hear_p2pd() -> None:
    """p2pd's own log lines about hole punching and reachability, raw on stderr (hivemind
    downgrades them to DEBUG and drops them otherwise)."""
    from hivemind.p2p import P2P

    def hear(line: str) -> None:
        if any(k in line for k in ("holepunch", "autonat", "autorelay", "reachab")):
            print(line, file=sys.stderr, flush=True)

    P2P._log_p2pd_message = staticmethod(hear)  # type: ignore[method-assign]


def _listen(quic: bool, port: int) -> list[str]:
    tcp = [f"/ip4/0.0.0.0/tcp/{port}"]
    return [*tcp, f"/ip4/0.0.0.0/udp/{port}/quic-v1"] if quic else tcp


async def public(address: str, quic: bool) -> None:
    """A public p2pd (the relay, or an observer): forced public, so it relays and observes."""
    from dht.reachability import RelayLimits, tuned_p2p

    _hear_p2pd()
    announce = [f"/ip4/{address}/tcp/{PORT}"]
    if quic:
        announce.append(f"/ip4/{address}/udp/{PORT}/quic-v1")
    p2p = await tuned_p2p(RelayLimits().daemon_flags()).create(
        host_maddrs=_listen(quic, PORT),
        announce_maddrs=announce,
        force_reachability="public",
        use_relay=True,
        startup_timeout=30,
    )
    _say(role="public", maddrs=[f"{m}/p2p/{p2p.peer_id}" for m in announce])
    await asyncio.sleep(3600)


async def home(
    relay: str, publics: list[str], target: str | None, quic: bool, wait_s: float, redial_s: float
) -> None:
    """A NAT'd p2pd as a node starts one (--auto-relay, --peers = every public machine);
    with `target` (a relayed address), dial it once this home holds a slot, then watch,
    dialling it again through the relay every `redial_s` (0: never) while no direct
    connection appears."""
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    from dht.reachability import RelayLimits, daemon_flags, is_relayed, tuned_p2p

    _hear_p2pd()
    flags = daemon_flags(use_auto_relay=True, initial_peers=[relay], limits=RelayLimits())
    p2p = await tuned_p2p(flags).create(
        initial_peers=publics,
        host_maddrs=_listen(quic, 0),
        trusted_relays=[relay],
        use_relay=True,
        use_auto_relay=True,
        check_if_identity_free=False,
        startup_timeout=30,
    )
    started = time.monotonic()
    while True:
        own = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
        if any(is_relayed(m) for m in own):
            break
        await asyncio.sleep(0.5)
    _say(
        role="home",
        peer_id=str(p2p.peer_id),
        addrs=own,
        slot_after_s=round(time.monotonic() - started, 1),
    )
    if target is None:
        await asyncio.sleep(3600)
        return
    peer = PeerID.from_base58(target.rsplit("/p2p/", 1)[-1])
    # p2pd's DHT may have dialled the target through the relay at start, before this host's
    # DCUtR handler was up: that connection's one punch failed ("protocols not supported").
    # A fresh relayed connection lets the target start another (svc.go: on inbound relayed).
    before = [[str(a) for a in p.addrs] for p in await p2p.list_peers() if p.peer_id == peer]
    _say(role="dialer", connected_before=before)
    await p2p._client.disconnect(peer)
    await p2p._client.connect(peer, [Multiaddr(target)])
    dialled = last_dial = time.monotonic()
    _say(role="dialer", relayed_connect=True)
    seen: list[list[str]] = []
    while time.monotonic() - dialled < wait_s:
        if redial_s and time.monotonic() - last_dial > redial_s:
            await p2p._client.disconnect(peer)
            await p2p._client.connect(peer, [Multiaddr(target)])
            last_dial = time.monotonic()
            _say(role="dialer", redialled_at_s=round(last_dial - dialled, 1))
        conns = [
            [str(a) for a in p.addrs] for p in await p2p.list_peers() if str(p.peer_id) == str(peer)
        ]
        addrs = [a for c in conns for a in c]
        if addrs and addrs not in seen:
            seen.append(addrs)
            _say(role="dialer", at_s=round(time.monotonic() - dialled, 1), connections=addrs)
        if any(not is_relayed(a) for a in addrs):
            _say(role="dialer", direct_after_s=round(time.monotonic() - dialled, 1), via=addrs)
            break
        await asyncio.sleep(0.5)
    own = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
    _say(role="dialer", done=True, own_addrs=own)
    await p2p.shutdown()


def run_bed(
    observers: int, nats: list[str], quic: bool, wait_s: float, redial_s: float, log_dir: Path
) -> dict[str, Any]:
    from bench.nat import Home, NatLab
    from bench.procs import ChildProcess, python_module

    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ["GOLOG_LOG_LEVEL"] = GOLOG
    me = python_module("bench.punch_probe")
    q = ["--quic"] if quic else []
    homes = tuple(Home(n) for n in nats)
    with NatLab(num_public=1 + observers, homes=homes, down_mbit=None, up_mbit=None) as lab:
        dirs = Path(tempfile.mkdtemp(prefix="punch-probe-"))
        children: list[Any] = []
        try:
            publics = []
            for i in range(1 + observers):
                child = ChildProcess(
                    f"pub{i}", [*me, "public", lab.public_address(i), *q],
                    home=dirs / f"pub{i}", prefix=lab.prefix(lab.public(i)),
                )  # fmt: skip
                children.append(child.start())
            for child in children:
                said = child.wait_for(lambda e: e.get("role") == "public", 60, "a public p2pd")
                publics.append(said["maddrs"][0])
            relay, peers = publics[0], ",".join(publics)
            listener = ChildProcess(
                "home1", [*me, "home", relay, peers, "-", *q],
                home=dirs / "home1", prefix=lab.prefix(lab.host(1)),
            )  # fmt: skip
            children.append(listener.start())
            ready = listener.wait_for(lambda e: e.get("role") == "home", 120, "home1's slot")
            circuit = next(a for a in ready["addrs"] if "p2p-circuit" in a)
            target = (
                circuit
                if "/p2p/" in circuit.split("p2p-circuit")[-1]
                else f"{circuit}/p2p/{ready['peer_id']}"
            )
            dialer = ChildProcess(
                "home0", [*me, "home", relay, peers, target, *q, "--wait-s", str(wait_s),
                 "--redial-s", str(redial_s)],
                home=dirs / "home0", prefix=lab.prefix(lab.host(0)),
            )  # fmt: skip
            children.append(dialer.start())
            dialer.wait_exit(120 + wait_s)
            said = [e for e in dialer.events if e.get("event") == "probe"]
            direct = [e["direct_after_s"] for e in said if "direct_after_s" in e]
            return {
                "observers": observers,
                "nats": nats,
                "quic": quic,
                "direct_after_s": direct[0] if direct else None,
                "home1": ready,
                "home0": said,
                "holepunch_log": {
                    c.name: [line for line in c.stderr if "holepunch" in line][-30:]
                    for c in (listener, dialer)
                },
            }
        finally:
            for child in children:
                child.reap()
                (log_dir / f"{child.name}.stderr").write_text("\n".join(child.stderr))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("public", "home"):
        sub = argparse.ArgumentParser()
        sub.add_argument("role")
        sub.add_argument("args", nargs="*")
        sub.add_argument("--quic", action="store_true")
        sub.add_argument("--wait-s", type=float, default=60.0)
        sub.add_argument("--redial-s", type=float, default=0.0)
        a = sub.parse_args()
        if a.role == "public":
            asyncio.run(public(a.args[0], a.quic))
        else:
            relay, peers, target = a.args
            target_or_none = None if target == "-" else target
            asyncio.run(home(relay, peers.split(","), target_or_none, a.quic, a.wait_s, a.redial_s))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--observers", type=int, default=4)
    parser.add_argument("--nats", default="cone,cone")
    parser.add_argument("--quic", action="store_true")
    parser.add_argument("--wait-s", type=float, default=60.0)
    parser.add_argument(
        "--redial-s",
        type=float,
        default=20.0,
        help="redial through the relay this often (0: never)",
    )
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/punch_probe"))
    args = parser.parse_args()
    nats = args.nats.split(",")
    print(
        json.dumps(
            run_bed(args.observers, nats, args.quic, args.wait_s, args.redial_s, args.log_dir)
        )
    )


if __name__ == "__main__":
    main()
