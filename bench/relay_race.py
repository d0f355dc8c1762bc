"""Which of p2pd's two relay services serves a circuit: the one -relayDataLimit configures, or
the default one (128 KiB) that hivemind 1.1.12's p2pd adds beside it (docs/nat.md, "The relay's
128 KiB cut").

    PYTHONPATH=$PWD python -m bench.relay_race --force-public 0 --observers 1 --settle-s 30

A bare relay (hivemind's P2P with the node's p2pd flags) runs on the bed's public machine 0 with
`--relay-max-mb` as its configured limit, told it is public (`--force-public 1`, as `diloco-node
bootstrap` and `join --announce` do) or left to AutoNAT (`0`); `--observers K` bare peers on
public machines 1..K, forced public, answer its AutoNAT dial-backs (a NAT'd home stops serving
AutoNAT once it knows it is private; `--observer-force 0`: left to AutoNAT too), and
`--relay-gomaxprocs N` runs the relay's p2pd with GOMAXPROCS=N. After `--settle-s` a receiver
behind the symmetric NAT reserves a slot with the relay (`--rereserve-s S`: and again S s after
its autorelay slot), and a sender behind the cone NAT writes `--mb` megabytes per stream through
the relay. A stream that ends near `--relay-max-mb` was served by the configured service, one
that ends near 128 KiB by the default one, one that arrives whole by the configured one with a
larger limit.
The final JSON line lists each stream's bytes.
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

from bench.relay_probe import _p2p, count_streams, send

PORT = 4100


def _say(**fields: Any) -> None:
    print(json.dumps({"event": "race", **fields}), flush=True)


async def relay(address: str, force: bool, max_mb: float, peers: list[str]) -> None:
    from dht.reachability import RelayLimits, daemon_flags, tuned_p2p

    limits = RelayLimits(max_bytes=int(max_mb * 1e6))
    flags = daemon_flags(use_auto_relay=False, initial_peers=peers, limits=limits)
    p2p = await tuned_p2p(flags).create(
        initial_peers=peers or None,
        host_maddrs=[f"/ip4/0.0.0.0/tcp/{address.rsplit('/', 1)[-1]}"],
        announce_maddrs=[address],
        force_reachability="public" if force else None,
        check_if_identity_free=False,
        startup_timeout=30,
    )
    _say(role="relay", full=f"{address}/p2p/{p2p.peer_id}")
    await asyncio.sleep(3600)


async def receiver(relay_maddr: str, rereserve_s: float) -> None:
    """Count each stream's bytes; say `ready` once a relayed address is known (and, with
    `rereserve_s`, once a slot was reserved again that long after it)."""
    from hivemind.p2p.p2p_daemon_bindings.control import DaemonConnector

    from dht.p2pd import reserve_slot

    started = time.monotonic()
    p2p = await _p2p(relay_maddr)
    await count_streams(p2p, _say)
    while not [m for m in await p2p.get_visible_maddrs(latest=True) if "p2p-circuit" in str(m)]:
        await asyncio.sleep(0.5)
    slot_s = time.monotonic() - started
    status = None
    if rereserve_s > 0:
        await asyncio.sleep(rereserve_s)
        connector = DaemonConnector(p2p.daemon_listen_maddr)
        status = await reserve_slot(connector, relay_maddr.rsplit("/p2p/", 1)[-1])
    _say(role="receiver", ready=True, peer_id=str(p2p.peer_id), at=round(slot_s, 1), reserve=status)
    await asyncio.sleep(3600)


def run_bed(args: argparse.Namespace) -> dict[str, Any]:
    from bench.nat import NatLab
    from bench.procs import ChildProcess, python_module

    args.log_dir.mkdir(parents=True, exist_ok=True)
    os.environ["GOLOG_LOG_LEVEL"] = "error,relay=debug,p2p-circuit=debug"
    me = python_module("bench.relay_race")
    homes = Path(tempfile.mkdtemp(prefix="relay-race-"))
    children: list[ChildProcess] = []

    def spawn(name: str, argv: list[str], namespace: str) -> ChildProcess:
        child = ChildProcess(name, argv, home=homes / name, prefix=NatLab.prefix(namespace))
        children.append(child.start())
        return child

    with NatLab(num_public=1 + args.observers, down_mbit=None, up_mbit=None) as lab:
        try:
            address = f"/ip4/{lab.public_address(0)}/tcp/{PORT}"
            procs = ["env", f"GOMAXPROCS={args.relay_gomaxprocs}"] if args.relay_gomaxprocs else []
            boot = spawn(
                "relay",
                [*procs, *me, "relay", address, str(args.force_public), str(args.relay_max_mb)],
                lab.public(0),
            )
            full = boot.wait_for(lambda e: "full" in e, 60, "the relay's address")["full"]
            started = time.monotonic()
            for i in range(1, args.observers + 1):
                observer = f"/ip4/{lab.public_address(i)}/tcp/{PORT}"
                force = str(args.observer_force)
                spawn(f"obs{i}", [*me, "relay", observer, force, "1024", full], lab.public(i))
            time.sleep(args.settle_s)
            recv = spawn("recv", [*me, "receive", full, str(args.rereserve_s)], lab.host(1))
            ready = recv.wait_for(lambda e: "ready" in e, 90 + args.rereserve_s, "a slot")
            snd = spawn(
                "send",
                [*me, "send", full, ready["peer_id"], f"{full}/p2p-circuit",
                 str(int(args.mb * 1e6)), str(args.num_streams)],
                lab.host(0),
            )  # fmt: skip
            snd.wait_exit(60 + 30 * args.num_streams)
            time.sleep(2)
            return {
                "force_public": args.force_public,
                "observers": args.observers,
                "observer_force": args.observer_force,
                "relay_gomaxprocs": args.relay_gomaxprocs,
                "settle_s": args.settle_s,
                "relay_max_mb": args.relay_max_mb,
                "slot_after_s": ready.get("at"),
                "since_relay_s": round(time.monotonic() - started, 1),
                "reserve": ready.get("reserve"),
                "sent": [e["sent"] for e in snd.events if e.get("role") == "sender"],
                "received": [e["received"] for e in recv.events if "received" in e],
                "relay_log": [line for line in boot.stderr if "relayed" in line][-10:],
            }
        finally:
            for child in children:
                child.reap()
                (args.log_dir / f"{child.name}.stderr").write_text("\n".join(child.stderr))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "relay":
        address, force, max_mb, *peers = sys.argv[2:]
        asyncio.run(relay(address, force == "1", float(max_mb), peers))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "receive":
        asyncio.run(receiver(sys.argv[2], float(sys.argv[3])))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "send":
        relay_maddr, target, circuit, n, k = sys.argv[2:7]
        asyncio.run(send(relay_maddr, target, circuit, int(n), int(k)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force-public", type=int, choices=(0, 1), default=1)
    parser.add_argument("--observers", type=int, default=0)
    parser.add_argument("--observer-force", type=int, choices=(0, 1), default=1)
    parser.add_argument("--relay-gomaxprocs", type=int, default=0, help="0: Go's default")
    parser.add_argument("--settle-s", type=float, default=0.0)
    parser.add_argument("--rereserve-s", type=float, default=0.0)
    parser.add_argument("--relay-max-mb", type=float, default=0.5)
    parser.add_argument("--mb", type=float, default=2.0)
    parser.add_argument("--num-streams", type=int, default=2)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/relay_race"))
    print(json.dumps(run_bed(parser.parse_args())))


if __name__ == "__main__":
    main()
