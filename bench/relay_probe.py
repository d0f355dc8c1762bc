"""How many bytes one stream carries between two homes through a relay (bench.nat's bed).

    PYTHONPATH=$PWD python -m bench.relay_probe --mb 4 --num-streams 3

A `diloco-node bootstrap` relays on the public machine; a receiver behind the symmetric NAT
reserves a slot with it and counts what each stream brings; a sender behind the cone NAT dials
it through the relay and writes `--mb` megabytes per stream. The final JSON line lists, per
stream, the bytes sent and received and how each side saw the stream end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PROTOCOL = "/probe/relay/1"
CHUNK = 64 << 10
PORT = 4100


async def _p2p(relay: str) -> Any:
    from dht.reachability import RelayLimits, daemon_flags, tuned_p2p

    flags = daemon_flags(use_auto_relay=True, initial_peers=[relay], limits=RelayLimits())
    return await tuned_p2p(flags).create(
        initial_peers=[relay],
        host_maddrs=["/ip4/0.0.0.0/tcp/0"],
        trusted_relays=[relay],
        use_relay=True,
        use_auto_relay=True,
        check_if_identity_free=False,
        startup_timeout=30,
    )


def _say(**fields: Any) -> None:
    print(json.dumps({"event": "probe", **fields}), flush=True)


async def count_streams(p2p: Any, say: Callable[..., None]) -> None:
    """Serve PROTOCOL on `p2p`: each stream read to its end, then one `say` line with its
    bytes and how it ended."""

    async def count(_info: Any, reader: asyncio.StreamReader, writer: Any) -> None:
        received, error = 0, "eof"
        try:
            while chunk := await reader.read(CHUNK):
                received += len(chunk)
        except Exception as exc:  # what ends a stream is what is measured
            error = repr(exc)
        say(role="receiver", received=received, end=error)
        writer.close()

    await p2p.add_binary_stream_handler(PROTOCOL, count)


async def receive(relay: str) -> None:
    """Print the relayed address once reserved, then one line per stream received."""
    p2p = await _p2p(relay)
    await count_streams(p2p, _say)
    while True:
        circuits = [
            str(m) for m in await p2p.get_visible_maddrs(latest=True) if "p2p-circuit" in str(m)
        ]
        if circuits:
            _say(role="receiver", peer_id=str(p2p.peer_id), circuits=circuits)
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(3600)


async def send(relay: str, target: str, circuit: str, num_bytes: int, num_streams: int) -> None:
    from hivemind.p2p import PeerID
    from multiaddr import Multiaddr

    p2p = await _p2p(relay)
    peer = PeerID.from_base58(target)
    await p2p._client.connect(peer, [Multiaddr(circuit)])
    for _ in range(num_streams):
        sent, error = 0, "closed"
        started = time.monotonic()
        try:
            _, _, writer = await p2p.call_binary_stream_handler(peer, PROTOCOL)
            while sent < num_bytes:
                writer.write(b"\0" * CHUNK)
                await writer.drain()
                sent += CHUNK
            writer.close()
        except Exception as exc:
            error = repr(exc)
        _say(role="sender", sent=sent, end=error, seconds=round(time.monotonic() - started, 2))
        await asyncio.sleep(1.0)
    await p2p.shutdown()


def run_bed(
    megabytes: float, num_streams: int, log_dir: Path, relay_max_mb: float | None = None
) -> dict[str, Any]:
    from bench.nat import NatLab
    from bench.procs import ChildProcess, python_module

    log_dir.mkdir(parents=True, exist_ok=True)
    env_debug = {"GOLOG_LOG_LEVEL": "error,relay=debug,p2p-circuit=debug"}
    os.environ.update(env_debug)  # the relay's "relayed N bytes" lines, in boot.stderr
    with NatLab(down_mbit=None, up_mbit=None) as lab:
        address = f"/ip4/{lab.public_address(0)}/tcp/{PORT}"
        argv = python_module("node", "bootstrap", "--port", str(PORT), "--announce", address)
        if relay_max_mb is not None:
            argv += ["--relay-max-mb", str(relay_max_mb)]
        homes = Path(tempfile.mkdtemp(prefix="relay-probe-"))  # one HOME each: reaped apart
        boot = ChildProcess("boot", argv, home=homes / "boot", prefix=lab.prefix(lab.public(0)))
        children = [boot.start()]
        try:
            relay = _wait_line(boot, f"{address}/p2p/")
            me = python_module("bench.relay_probe")
            recv = ChildProcess(
                "recv", [*me, "receive", relay], home=homes / "recv", prefix=lab.prefix(lab.host(1))
            )
            children.append(recv.start())
            ready = recv.wait_for(lambda e: "circuits" in e, 90, "a relayed address")
            snd = ChildProcess(
                "send",
                [*me, "send", relay, ready["peer_id"], f"{relay}/p2p-circuit",
                 str(int(megabytes * 1e6)), str(num_streams)],
                home=homes / "send", prefix=lab.prefix(lab.host(0)),
            )  # fmt: skip
            children.append(snd.start())
            snd.wait_exit(60 + 30 * num_streams)
            time.sleep(2)
            return {
                "sent": [e for e in snd.events if e.get("role") == "sender"],
                "received": [e for e in recv.events if "received" in e],
                "relay_log": [line for line in boot.stderr if "relay" in line][-40:],
            }
        finally:
            for child in children:
                child.reap()
                (log_dir / f"{child.name}.stderr").write_text("\n".join(child.stderr))


def _wait_line(child: Any, start: str, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        said = [w for line in child.stderr for w in line.split() if w.startswith(start)]
        if said:
            return str(said[0])
        time.sleep(0.2)
    raise TimeoutError(child.stderr_tail())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "receive":
        asyncio.run(receive(sys.argv[2]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "send":
        relay, target, circuit, n, k = sys.argv[2:7]
        asyncio.run(send(relay, target, circuit, int(n), int(k)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=4.0)
    parser.add_argument("--num-streams", type=int, default=3)
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/relay_probe"))
    parser.add_argument("--relay-max-mb", type=float, help="the bootstrap's (default: its own)")
    args = parser.parse_args()
    print(json.dumps(run_bed(args.mb, args.num_streams, args.log_dir, args.relay_max_mb)))


if __name__ == "__main__":
    main()
