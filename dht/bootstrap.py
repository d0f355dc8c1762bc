"""A public bootstrap and relay that trains nothing: `diloco-node bootstrap`.

It runs the same DHT as hivemind's own bootstrap (`hivemind-dht`), on a p2pd told it is public
(its --announce address), so it relays for peers behind NAT from its first second instead of
after AutoNAT has confirmed it public. Like every relay of hivemind 1.1.12's p2pd, it may cut a
relayed connection every 128 KiB whatever RelayLimits says (dht.resumable says why); transfers
resume across the cuts."""

from __future__ import annotations

import asyncio
import logging
import threading

from hivemind import DHT

from dht.reachability import RelayLimits, daemon_flags, tuned_p2p

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 30.0


async def _start_p2p(
    host_maddrs: list[str], announce: list[str], limits: RelayLimits, peers: list[str]
) -> object:
    flags = daemon_flags(use_auto_relay=False, initial_peers=peers, limits=limits)
    return await tuned_p2p(flags).create(
        initial_peers=peers or None,
        check_if_identity_free=False,
        host_maddrs=host_maddrs,
        announce_maddrs=announce,
        force_reachability="public",
        identity_path=None,
        startup_timeout=STARTUP_TIMEOUT_S,
    )


def run_bootstrap(
    host_maddrs: list[str],
    announce: list[str],
    limits: RelayLimits,
    stop: threading.Event,
    *,
    initial_peers: list[str] | None = None,
) -> list[str]:
    """Serve until `stop` is set; the full addresses are printed once serving."""
    if not announce:
        raise ValueError("a bootstrap relays only at a public address: pass --announce")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bootstrap", daemon=True)
    thread.start()
    p2p = asyncio.run_coroutine_threadsafe(
        _start_p2p(host_maddrs, announce, limits, initial_peers or []), loop
    ).result(STARTUP_TIMEOUT_S + 5)
    dht = DHT(initial_peers=initial_peers or None, p2p=p2p, start=True)  # type: ignore[arg-type]
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        print("bootstrap and relay at " + " ".join(maddrs), flush=True)
        stop.wait()
        return maddrs
    finally:
        dht.shutdown()
        asyncio.run_coroutine_threadsafe(p2p.shutdown(), loop).result(10)  # type: ignore[attr-defined]
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
