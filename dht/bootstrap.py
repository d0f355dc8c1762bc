"""A public bootstrap and relay that trains nothing: `diloco-node bootstrap`.

It runs the same DHT as hivemind's own bootstrap (`hivemind-dht`), on a p2pd told it is public
(its --announce address), so it relays for peers behind NAT from its first second instead of
after AutoNAT has confirmed it public, with the limits RelayLimits sets (its p2pd runs with
GOMAXPROCS=1 so that the configured relay service, not go-libp2p's default one that cuts every
128 KiB, serves circuits: dht.reachability.daemon_env); transfers resume across cuts anyway.

Its p2pd runs with a key file (`identity_path`, an Ed25519 libp2p key: merge.identity), so a
restarted bootstrap keeps its peer id and the `--peers .../p2p/ID` addresses naming it."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from pathlib import Path

from hivemind import DHT

from dht.reachability import RelayLimits, daemon_env, daemon_flags, tuned_p2p
from dht.reaper import OrphanReaper

logger = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 30.0


async def _start_p2p(
    host_maddrs: list[str],
    announce: list[str],
    limits: RelayLimits,
    peers: list[str],
    identity_path: str,
) -> object:
    flags = daemon_flags(use_auto_relay=False, initial_peers=peers, limits=limits)
    return await tuned_p2p(flags, daemon_env(force_public=True)).create(
        initial_peers=peers or None,
        check_if_identity_free=False,
        host_maddrs=host_maddrs,
        announce_maddrs=announce,
        force_reachability="public",
        identity_path=identity_path,
        startup_timeout=STARTUP_TIMEOUT_S,
    )


def run_bootstrap(
    host_maddrs: list[str],
    announce: list[str],
    limits: RelayLimits,
    stop: threading.Event,
    *,
    identity_path: str,
    initial_peers: list[str] | None = None,
) -> list[str]:
    """Serve as the identity in `identity_path` (an existing key: p2pd would make an RSA one)
    until `stop` is set; the full addresses are printed once serving."""
    if not announce:
        raise ValueError("a bootstrap relays only at a public address: pass --announce")
    if not Path(identity_path).is_file():
        raise ValueError(f"identity file {identity_path} does not exist (diloco-node keygen)")
    peers = initial_peers or []
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="bootstrap", daemon=True)
    thread.start()
    reaper = OrphanReaper()  # a bootstrap killed with -9 leaves no p2pd and DHT holding its key
    reaper.start()
    try:
        return _serve(loop, reaper, stop, host_maddrs, announce, limits, peers, identity_path)
    finally:
        reaper.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)


def _serve(
    loop: asyncio.AbstractEventLoop,
    reaper: OrphanReaper,
    stop: threading.Event,
    host_maddrs: list[str],
    announce: list[str],
    limits: RelayLimits,
    peers: list[str],
    identity_path: str,
) -> list[str]:
    p2p = asyncio.run_coroutine_threadsafe(
        _start_p2p(host_maddrs, announce, limits, peers, identity_path), loop
    ).result(STARTUP_TIMEOUT_S + 5)
    daemon = getattr(p2p, "_child", None)  # hivemind keeps p2pd's Process private
    if daemon is not None:
        reaper.watch(daemon.pid)
    dht = _start_dht(p2p, peers)
    reaper.watch(dht.pid)
    try:
        maddrs = [str(m) for m in dht.get_visible_maddrs()]
        print("bootstrap and relay at " + " ".join(maddrs), flush=True)
        stop.wait()
        return maddrs
    finally:
        dht.shutdown()
        asyncio.run_coroutine_threadsafe(p2p.shutdown(), loop).result(10)  # type: ignore[attr-defined]


def _start_dht(p2p: object, peers: list[str]) -> DHT:
    # The DHT forks: without the CLI's SIGTERM handler (node.signals), which the child would
    # inherit, so that DHT.shutdown's terminate() ends it. A child that outlived the bootstrap
    # kept its identity's lock, and the restarted bootstrap took another key (a new peer id).
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return DHT(initial_peers=peers or None, p2p=p2p, start=True, shutdown_timeout=3)  # type: ignore[arg-type]
    finally:
        signal.signal(signal.SIGTERM, previous)
