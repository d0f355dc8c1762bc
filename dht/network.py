"""The swarm's network core: one asyncio loop in a thread, this node's p2pd and DHT member.

Every other swarm part (membership, gossip, state transfer) talks to the network through
this class: DHT records with bounded waits, request/response streams, protocol names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Collection, Coroutine
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

from hivemind import DHT
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.p2p.p2p_daemon_bindings.control import DaemonConnector
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils import get_dht_time
from multiaddr import Multiaddr

from dht.addresses import peer_id_of, without_peer_id
from dht.doctor import probe_bootstraps
from dht.join_report import bootstrap_failure
from dht.network_paths import NetworkPaths
from dht.network_punch import RedialPolicy, RedialSettings
from dht.network_streams import NetworkStreams
from dht.p2pd import (
    children_in_own_session,
)
from dht.p2pd_log import forward_p2pd_log
from dht.reachability import (
    PathBook,
    daemon_env,
    daemon_flags,
    tuned_p2p,
)
from dht.reaper import OrphanReaper
from dht.records import OwnerValidator, RefusalCounts
from dht.rejections import Rejections
from dht.swarm_config import (
    SwarmConfig,
    SwarmError,
)
from merge.identity import Identity

logger = logging.getLogger(__name__)
P2PD_STOP_S = 5.0
"""How long p2pd may take to exit on SIGTERM before hivemind's shutdown signals it again."""
T = TypeVar("T")


class SwarmNetwork(NetworkPaths, NetworkStreams):
    """p2pd, the DHT member and the loop they run on; thread-safe `call`, async internals."""

    def __init__(
        self, config: SwarmConfig, identity: Identity, reject: Rejections | None = None
    ) -> None:
        self.config = config
        self._reject = reject
        self.dht_refusals = RefusalCounts()
        """Records this node's DHT member refused (shared with its forked process)."""
        self._refusals_seen: dict[str, int] = {}
        self.peer_id = identity.peer_id
        self.identity = identity
        """This node's key: it signs heartbeats, records and the states it serves."""
        self.visible_maddrs: list[str] = []
        """This node's addresses: p2pd's, then the relayed ones of slots it reserved itself."""
        self.p2pd_maddrs: list[str] = []
        """p2pd's own list (its autorelay's slots among them)."""
        self._relayed: list[str] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="swarm", daemon=True)
        self._reaper = OrphanReaper()
        self._p2p: P2P | None = None
        self._p2pd_pids: list[int] = []
        """p2pd's pid (hivemind's P2P keeps it private), for the orphan reaper."""
        self._control: DaemonConnector | None = None
        self._dht: DHT | None = None
        self._background: set[asyncio.Task[None]] = set()
        self.paths = PathBook()
        """Which path (direct, hole-punched, relayed) each connected peer is on."""
        self._redial = RedialPolicy(self.peer_id, time.monotonic(), RedialSettings())
        """Which relayed peers to dial again so that DCUtR punches a hole (dht.network_punch)."""
        self.nat_peers: Callable[[], Collection[str]] = frozenset
        """Peers known to be behind a NAT (their heartbeats announce a relayed address): a
        direct connection to one, while this node is behind a NAT, was hole-punched."""
        self._behind_nat = False
        """This node has held a relayed address (a relay slot: AutoNAT found it private)."""
        self.on_addresses: Callable[[list[str]], None] | None = None
        """Called on the loop when this node's addresses change (a relay slot taken or lost)."""

    # ---- start and stop ---------------------------------------------------------------------

    def start(self, timeout_s: float) -> None:
        self.start_p2p(timeout_s)
        self.fork_dht()
        self.finish_start(timeout_s)

    def start_p2p(self, timeout_s: float) -> None:
        """The loop's thread, the orphan reaper and p2pd (any thread): `start`'s first part."""
        self._reaper.start()
        self._thread.start()
        if forward_p2pd_log():
            logger.info("p2pd's log lines (%s) are forwarded here", os.environ["GOLOG_LOG_LEVEL"])
        try:
            self._p2p = self._start_p2p(timeout_s)
        except SwarmError as exc:
            if not (self.config.rejoin_peers and self.config.initial_peers):
                raise
            # p2pd refuses to start when no bootstrap peer answers (one that went down after
            # the preflight's probe): a known member starts alone and dials them later.
            logger.info("%s; starting alone", exc)
            self.config = replace(self.config, initial_peers=[])
            self._p2p = self._start_p2p(timeout_s)
        for pid in self._p2pd_pids:
            self._reaper.watch(pid)
        # The daemon's control socket, as hivemind's own client reaches it (dht.p2pd).
        self._control = DaemonConnector(self._p2p.daemon_listen_maddr)

    def fork_dht(self) -> None:
        """Fork the DHT's process, without waiting for it: from the main thread, at a moment
        it holds no lock (a node calls it between inner steps). `start`'s second part."""
        self._dht = self._start_dht()

    def finish_start(self, timeout_s: float) -> None:
        """Wait until the DHT member is up (bootstrapped), then watch it and the paths (any
        thread). `start`'s last part."""
        assert self._dht is not None
        self._dht.wait_until_ready(timeout_s)
        assert self._dht.pid is not None
        self._reaper.watch(self._dht.pid)
        self.call(self._watch_paths(), timeout_s)

    def _start_p2p(self, timeout_s: float) -> P2P:
        try:
            return self.call(self._create_p2p(), timeout_s)
        except P2PDaemonError as exc:
            reason = str(exc).splitlines()[-1] if str(exc) else type(exc).__name__
            if "bootstrap peers" in reason and self.config.initial_peers:
                raise SwarmError(self._why_no_bootstrap(timeout_s)) from None
            peers = ", ".join(self.config.initial_peers) or "none"
            raise SwarmError(f"could not start the p2p daemon (peers: {peers}): {reason}") from None

    def _why_no_bootstrap(self, timeout_s: float) -> str:
        """p2pd says only "failed to connect to bootstrap peers": probe each (TCP, then the
        peer id its address names) to say which failed and why."""
        try:
            probes = self.call(probe_bootstraps(self.config.initial_peers), timeout_s)
        except Exception as exc:  # the probe itself failed: say what p2pd said
            logger.debug("probing the bootstrap peers failed: %r", exc)
            return "could not connect to a bootstrap peer: " + ", ".join(self.config.initial_peers)
        return bootstrap_failure(probes)

    def _start_dht(self) -> DHT:
        # The DHT forks; do it from this (main) thread rather than the loop's, and without
        # the node's SIGTERM handler, which would make the DHT child ignore SIGTERM.
        previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            return DHT(
                initial_peers=self.config.initial_peers or None,
                p2p=self._p2p,
                start=True,
                await_ready=False,  # finish_start waits, off the thread that forked
                client_mode=self.config.client_mode,
                shutdown_timeout=3,
                # a known member starts alone and dials its peers later (dht.bootstrap_rejoin);
                # a newcomer dials them again for a bound (dht.bootstrap_newcomer)
                ensure_bootstrap_success=False,
                wait_timeout=self.dht_wait_timeout_s,  # per request to one DHT member
                # [owner:PEER_ID] subkeys (heartbeats) only their owner can write
                record_validators=[OwnerValidator(self.identity, self.dht_refusals)],
            )
        finally:
            signal.signal(signal.SIGTERM, previous)

    async def _create_p2p(self) -> P2P:
        with children_in_own_session(self._p2pd_pids):
            return await self._spawn_p2p()

    async def _spawn_p2p(self) -> P2P:
        config = self.config
        flags = daemon_flags(
            use_auto_relay=config.use_auto_relay,
            initial_peers=config.bootstrap_peers,
            limits=config.relay_limits,
        )
        env = daemon_env(force_public=bool(config.announce_maddrs))
        return await tuned_p2p(flags, env).create(
            initial_peers=config.initial_peers or None,
            host_maddrs=config.host_maddrs,
            announce_maddrs=config.announce_maddrs or None,
            # a node told its public address serves as a relay before AutoNAT confirms it
            force_reachability="public" if config.announce_maddrs else None,
            # the bootstrap peers are the relays a node behind NAT reserves a slot with
            trusted_relays=config.bootstrap_peers if config.use_auto_relay else None,
            identity_path=config.identity_path,
            use_relay=config.use_relay,
            use_auto_relay=config.use_auto_relay,
            dht_mode="client" if config.client_mode else "server",
            check_if_identity_free=False,  # hivemind's check assumes RSA keys
            startup_timeout=30,
        )

    def shutdown(self) -> None:
        if self._thread.is_alive():
            try:
                self.call(self._cancel_tasks(), 10.0)
            except Exception as exc:  # shutting down: report, keep going
                logger.warning("stopping swarm tasks failed: %s", exc)
        if self._dht is not None:
            self._dht.shutdown()
        if self._p2p is not None and self._thread.is_alive():
            try:
                self.call(self._stop_p2pd(), 10.0)
            except Exception as exc:
                logger.warning("stopping p2pd failed: %s", exc)
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        self._reaper.close()

    async def _stop_p2pd(self) -> None:
        """SIGTERM p2pd, wait until asyncio's child watcher has reaped it, then let hivemind
        close the rest.

        Not hivemind's `P2P.shutdown` alone: it signals through `Popen.send_signal`, whose
        `poll()` reaps a p2pd that has just exited before asyncio's watcher thread, blocked in
        `waitpid`, does (CPython gh-87744, fixed in 3.13). The watcher then logs "Unknown child
        process pid N, will report returncode 255": the warning a node printed once on Ctrl+C
        (tests/node/test_stopping.py). `os.kill` reaps nothing, so the watcher always gets the
        exit status, and `P2P.shutdown` finds the returncode set and signals nothing.
        """
        assert self._p2p is not None
        child = getattr(self._p2p, "_child", None)  # hivemind keeps p2pd's Process private
        if child is not None and child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):  # then hivemind's terminate, as before
                await asyncio.wait_for(child.wait(), P2PD_STOP_S)
        await self._p2p.shutdown()

    async def _cancel_tasks(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- the loop ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run `coro` on the loop from another thread and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """A background task on the loop (call from the loop), kept referenced until done."""
        task = asyncio.create_task(coro)
        self._background.add(task)  # asyncio holds tasks weakly
        task.add_done_callback(self._background.discard)
        return task

    def every(self, period_s: float, action: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run `action` every `period_s` seconds until shutdown; failures are logged."""
        self.spawn(self._every(period_s, action))

    async def _every(
        self, period_s: float, action: Callable[[], Coroutine[Any, Any, None]]
    ) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await action()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the network misbehaved; try again next period
                logger.warning("%s failed: %s", getattr(action, "__name__", action), exc)

    # ---- DHT records ------------------------------------------------------------------------

    @property
    def dht_wait_timeout_s(self) -> float:
        return max(1.0, min(3.0, self.config.heartbeat_period_s))

    async def dht_get(self, key: str) -> dict[Any, Any]:
        """Subkey -> value of a dictionary record; {} when absent, malformed or too slow.

        Bounded: a frozen DHT member must not stall the poll loop (peers would look dead).
        """
        assert self._dht is not None
        try:
            found = await asyncio.wait_for(
                self._dht.get(key, latest=True, return_future=True),
                timeout=2 * self.dht_wait_timeout_s + 1,
            )
        except TimeoutError:
            logger.debug("DHT get %s timed out", key)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        return {subkey: item.value for subkey, item in found.value.items()}

    async def dht_store(self, key: str, subkey: str | int, value: Any, ttl_s: float) -> None:
        assert self._dht is not None
        await self._dht.store(key, value, get_dht_time() + ttl_s, subkey=subkey, return_future=True)

    async def dht_peer_count(self) -> int:
        """Peers in this node's DHT routing table (hivemind drops one that stops answering)."""
        assert self._dht is not None
        return int(await self._dht.run_coroutine(_routing_table_size, return_future=True))

    async def dial(self, maddr: str, timeout_s: float) -> bool:
        """Connect p2pd to `maddr` (ending in /p2p/ID) and ping that peer from the DHT member,
        which puts each in the other's routing table; whether it answered within `timeout_s`."""
        assert self._p2p is not None and self._dht is not None
        try:
            parsed = Multiaddr(maddr)
            peer_id = peer_id_of(parsed)
            await asyncio.wait_for(
                self._p2p._client.connect(PeerID.from_base58(peer_id), [without_peer_id(parsed)]),
                timeout_s,
            )
            ping = self._dht.run_coroutine(partial(_ping_peer, peer_id), return_future=True)
            return bool(await asyncio.wait_for(ping, timeout_s))
        except (TimeoutError, OSError, ValueError, P2PDaemonError, ControlFailure) as exc:
            logger.debug("dialling %s failed: %s", maddr, exc)
            return False


async def _routing_table_size(_dht: Any, node: Any) -> int:
    """In the DHT's process: how many peers its routing table holds."""
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _ping_peer(peer_id: str, _dht: Any, node: Any) -> bool:
    """In the DHT's process: ping `peer_id` (both routing tables learn the other), then look
    up this node's neighbourhood through it, as hivemind's own bootstrap does."""
    if await node.protocol.call_ping(PeerID.from_base58(peer_id)) is None:
        return False
    await node.find_nearest_nodes([node.node_id])
    return True
