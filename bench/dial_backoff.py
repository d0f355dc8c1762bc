"""How long after a peer is back p2pd connects to it again, dialled every `--period-s` while it
was down for `--down-s` (docs/nat.md, session 15: why the Rejoiner's cap is 3 s).

    PYTHONPATH=$PWD python -m bench.dial_backoff --down-s 25 --period-s 2

Two p2pds on loopback (hivemind's P2P): B, with a fixed Ed25519 key, serves once and stops; A
dials B's address every `--period-s` s; after `--down-s` s B starts again on the same address.
go-libp2p's swarm answers a dial to an address that failed k times in a row with `dial
backoff` at once, no packet sent, for 5 s + k^2 s, until a connection clears it: the figure is
that backoff's share of a reconnect. The final JSON line says when B was back and when A's
dial reached it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from typing import Any

from hivemind.p2p import P2P
from multiaddr import Multiaddr

from merge.identity import Identity

DIAL_TIMEOUT_S = 5.0


async def _serve(key: str, maddr: str) -> P2P:
    return await P2P.create(host_maddrs=[maddr], identity_path=key)


async def measure(down_s: float, period_s: float, port: int) -> dict[str, Any]:
    maddr = f"/ip4/127.0.0.1/tcp/{port}"
    key = os.path.join(tempfile.mkdtemp(prefix="dial-backoff-"), "b.key")
    Identity.generate().save(key)
    b = await _serve(key, maddr)
    b_id = b.peer_id
    await b.shutdown()
    a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    start = time.monotonic()
    back_at: float | None = None
    num_dials = 0
    try:
        while True:
            if back_at is None and time.monotonic() - start >= down_s:
                b = await _serve(key, maddr)
                back_at = time.monotonic() - start
            dialled_at = time.monotonic() - start
            num_dials += 1
            try:
                await asyncio.wait_for(a._client.connect(b_id, [Multiaddr(maddr)]), DIAL_TIMEOUT_S)
            except Exception:  # noqa: BLE001 -- refused, timed out or `dial backoff`: dial again
                await asyncio.sleep(period_s)
                continue
            if back_at is not None:
                return {
                    "down_s": down_s,
                    "period_s": period_s,
                    "back_at_s": round(back_at, 2),
                    "connected_at_s": round(dialled_at, 2),
                    "connected_after_back_s": round(dialled_at - back_at, 2),
                    "num_dials": num_dials,
                }
            await asyncio.sleep(period_s)
    finally:
        await a.shutdown()
        await b.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--down-s", type=float, default=25.0, help="how long B is down")
    parser.add_argument("--period-s", type=float, default=2.0, help="A dials every this often")
    parser.add_argument("--port", type=int, default=45711, help="B's loopback port")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.down_s, args.period_s, args.port))))


if __name__ == "__main__":
    main()
