"""The swarm: discovery, heartbeats, gossip of signed pseudo-gradients, state download.

A facade over the parts in dht/: the network core (network.py), membership and heartbeats
(membership.py), gossip (gossip.py over gossip_*.py) and state transfer (state_transfer.py).
Everything runs on one asyncio loop in a background thread, so the learner never waits on
the network.
hivemind's DHT (a forked process) holds small signed records: heartbeats, update
announcements (signed headers) and holder lists. Payloads and replica state travel over
libp2p streams of the node's own p2pd, never through DHT.store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from dht.bootstrap_newcomer import NEWCOMER_DHT_WAIT_S, await_first_peer
from dht.bootstrap_rejoin import REJOIN_TICK_S, Rejoiner
from dht.gossip import Gossip
from dht.heartbeat import Heartbeat
from dht.heartbeat_cadence import Cadence
from dht.join_report import ReachabilityNotes
from dht.membership import Membership, PeerView
from dht.merge_port import MergePort
from dht.network import SwarmNetwork
from dht.reachability import PathKind, is_relayed
from dht.realign import Realign, RealignConfig, RealignPolicy, lacking_retained, merge_retained
from dht.rejections import Rejections
from dht.retention import serve_superseded
from dht.state_donors import Skipped
from dht.state_refusal import StateRefusal
from dht.state_transfer import StateTransfer, TransferStats
from dht.swarm_config import RunMismatchError, SwarmConfig, SwarmError
from dht.transfer_progress import ProgressReport
from merge.envelope import SignedUpdate
from merge.identity import Identity
from merge.replica import Replica
from merge.result import MergeResult

logger = logging.getLogger(__name__)
RESUBMIT_AGAIN_PERIODS = 2
"""Heartbeat periods after a realignment before the retained updates are offered again: an
own update merged just before the adopt is retained a moment after it (dht.gossip_announce)."""
MAX_LISTED = 64
"""Update ids a `realigned` event lists (of those the donor's state lacked)."""

__all__ = [
    "PeerView",
    "RunMismatchError",
    "Swarm",
    "SwarmConfig",
    "SwarmError",
    "TransferStats",
]


class Swarm:
    """This node's membership in the swarm; thread-safe entry points, async internals."""

    def __init__(
        self,
        config: SwarmConfig,
        identity: Identity,
        replica: Replica,
        pipeline: MergePort,
        *,
        heartbeat_fn: Callable[[], Heartbeat],
        on_merge: Callable[[MergeResult], None],
        on_event: Callable[..., None],
    ) -> None:
        self.config = config
        self.peer_id = identity.peer_id
        self.replica = replica
        self.on_event = on_event
        self._heartbeat_fn = heartbeat_fn
        self._on_merge = on_merge
        self._pipeline = pipeline
        self._reject = Rejections(on_merge, pipeline.rejection_log)
        self.network = SwarmNetwork(config, identity, self._reject)
        self._merge_pool = ThreadPoolExecutor(1, thread_name_prefix="merge")
        self.membership = Membership(
            self.network,
            identity,
            heartbeat_fn=heartbeat_fn,
            reject=self._reject,
            on_event=on_event,
        )
        self.network.on_heard = self.membership.heard_from
        self.gossip = Gossip(
            self.network,
            self.membership,
            pipeline,
            merge_pool=self._merge_pool,
            reject=self._reject,
            on_merge=on_merge,
            on_event=on_event,
        )
        self.transfer = StateTransfer(
            self.network,
            self.membership,
            pipeline,
            merge_pool=self._merge_pool,
            reject=self._reject,
            on_event=on_event,
        )
        self.gossip.retained.is_fresh = pipeline.is_fresh_author  # they share a budget
        serve_superseded(pipeline, self.gossip.retained)  # a group id's variant, once replaced
        self.membership.on_left = self.gossip.forget_peer
        self.membership.has_record = lambda peer_id: replica.last_seq(peer_id) >= 1
        self._publishing: set[concurrent.futures.Future[None]] = set()
        self.rejoiner: Rejoiner | None = None
        """The background dialling of the bootstrap and known peers (None: this node has none)."""
        self._reachability = ReachabilityNotes(
            announce_given=bool(config.announce_maddrs), use_auto_relay=config.use_auto_relay
        )
        self.network.on_addresses = self._addresses_changed
        self.network.nat_peers = self._peers_behind_nat
        self.realignment = RealignPolicy(
            RealignConfig(period_s=config.heartbeat_period_s), identity.peer_id
        )
        """When to replace this replica's parameters by a peer's (dht.realign)."""
        self.gossip.repair.on_unreachable = self.realignment.note_gap
        self.on_realigned: Callable[[], None] = lambda: None
        """Called (off the loop) once a realignment loaded a donor's state: the node resketches
        the replica and counts it."""
        self._realigning: asyncio.Task[None] | None = None

    # ---- what the node and the dashboard read -----------------------------------------------

    @property
    def peers(self) -> dict[str, PeerView]:
        return self.membership.peers

    @property
    def rejections(self) -> Counter[str]:
        return self._reject.counts

    @property
    def fetches(self) -> deque[TransferStats]:
        return self.gossip.fetches

    @property
    def visible_maddrs(self) -> list[str]:
        return self.network.visible_maddrs

    @property
    def paths(self) -> dict[PathKind, int]:
        """Connected peers per path (direct, holepunched, relayed), as last read from p2pd."""
        return self.network.paths.counts()

    @property
    def state_download(self) -> ProgressReport | None:
        """The running state download's bytes, rate and ETA (None: none running)."""
        return self.transfer.progress

    @property
    def num_lost(self) -> int:
        """Updates this node knows exist but that no live peer could give it."""
        return self.gossip.num_lost

    @property
    def num_need_state(self) -> int:
        """Updates this node wants that only a live peer's state brings (not lost)."""
        return self.gossip.num_need_state

    def alive_peers(self) -> list[Heartbeat]:
        return self.membership.alive_peers()

    def _peers_behind_nat(self) -> set[str]:
        """Live peers whose heartbeats announce a relayed address (behind a NAT)."""
        return {h.peer_id for h in self.alive_peers() if any(map(is_relayed, h.maddrs))}

    def tell_reachability(self) -> None:
        """A `reachability` event: how peers reach this node (after `start`; again on each
        change)."""
        found = self._reachability.first(self.network.visible_maddrs)
        self.on_event("reachability", line=found.line, relays=found.relays, maddrs=found.announced)

    def _addresses_changed(self, maddrs: list[str]) -> None:
        found = self._reachability.update(maddrs)
        if found is not None:
            self.on_event(
                "reachability", line=found.line, relays=found.relays, maddrs=found.announced
            )

    # ---- thread-safe entry points --------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> list[str]:
        """Start p2pd and the DHT, refuse a mismatched run, begin heartbeats.

        Gossip starts with start_gossip(), after an optional download_state().
        """
        self.start_p2p(timeout_s)
        self.fork_dht()
        return self.finish_start(timeout_s)

    def start_p2p(self, timeout_s: float = 60.0) -> None:
        """`start`'s first part, from any thread: p2pd."""
        self.network.start_p2p(timeout_s)

    def fork_dht(self) -> None:
        """`start`'s second part: fork the DHT's process (main thread, holding no lock)."""
        self.network.fork_dht()

    def finish_start(self, timeout_s: float = 60.0) -> list[str]:
        """`start`'s last part, from any thread: the DHT up, the run check, heartbeats."""
        self.network.finish_start(timeout_s)
        self.on_event("startup_phase", name="p2pd")  # p2pd and the DHT's process
        self.network.call(self._register_handlers(), timeout_s)
        maddrs = self.network.read_visible_maddrs()
        if self.config.rejoin_peers or self.config.bootstrap_peers:  # lost them? dial again
            # a newcomer whose bootstrap's DHT was slow to answer dials it again, for a bound,
            # before the run check (which reads the swarm's DHT)
            self.network.call(self._start_rejoining(), timeout_s + NEWCOMER_DHT_WAIT_S)
        self.network.call(self.membership.check_run(), timeout_s)
        self.network.call(self._start_heartbeats(), timeout_s)
        self.on_event("startup_phase", name="dht_bootstrap")  # the run check, a heartbeat
        return maddrs

    def start_gossip(self, timeout_s: float = 60.0) -> None:
        """Begin fetching and merging peers' updates in the background."""
        self.network.call(self._start_gossip(), timeout_s)

    def download_state(self, timeout_s: float = 300.0) -> TransferStats | Skipped:
        """Replace the replica with the most advanced live peer's, if any peer is ahead; else
        why not (dht.state_donors)."""
        return self.network.call(self.transfer.download(), timeout_s)

    def announced_seq(self) -> int:
        """The highest seq this identity has announced and the swarm still remembers."""
        return self.network.call(self.gossip.announced_seq(self.peer_id), 30.0)

    def publish(self, update: SignedUpdate) -> None:
        """Announce an update this node authored and merged; never blocks the caller."""
        future = asyncio.run_coroutine_threadsafe(self.gossip.publish(update), self.network.loop)
        # asyncio holds tasks weakly: without this reference a publish waiting on the DHT
        # can be garbage-collected half-way.
        self._publishing.add(future)
        future.add_done_callback(self._publishing.discard)

    def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for this node's publishes in flight; how many did not end."""
        pending = list(self._publishing)
        concurrent.futures.wait(pending, timeout=timeout_s)
        return sum(not f.done() for f in pending)

    def shutdown(self) -> None:
        self.network.shutdown()
        self.gossip.retained.close()
        self._merge_pool.shutdown(wait=True, cancel_futures=True)

    # ---- on the loop ------------------------------------------------------------------------

    async def _register_handlers(self) -> None:
        await self.gossip.register()
        await self.transfer.register()

    async def _start_heartbeats(self) -> None:
        period, started = self.config.heartbeat_period_s, time.monotonic()
        await self.membership.send_heartbeat()
        cadence = Cadence(period, next_at=started + period, last_stored=time.monotonic())
        self.network.spawn(self._heartbeats(cadence))

    async def _heartbeats(self, cadence: Cadence) -> None:
        """A heartbeat stored every period on a fixed cadence (dht.heartbeat_cadence)."""
        while True:
            await asyncio.sleep(cadence.wait_s(time.monotonic()))
            if cadence.start(time.monotonic()):
                self.network.spawn(self._beat(cadence))

    async def _beat(self, cadence: Cadence) -> None:
        stored = False
        try:
            await self.membership.send_heartbeat()
            stored = True
        except Exception as exc:  # the DHT misbehaved: the next one is due in a period
            logger.warning("storing a heartbeat failed: %s", exc)
        finally:
            gap = cadence.done(time.monotonic(), stored=stored)
        if gap is not None:
            self.on_event("heartbeat_late", gap_s=round(gap, 3), period_s=cadence.period_s)

    async def _start_rejoining(self) -> None:
        config = self.config
        rejoiner = Rejoiner(
            self.network,
            config.rejoin_peers or config.bootstrap_peers,
            bootstraps=config.bootstrap_peers or None,
            wants_relay=config.use_auto_relay and not config.announce_maddrs,
        )
        self.rejoiner = rejoiner
        # a known member (it has a checkpoint) found nobody: it trains, and dials them later
        if config.rejoin_peers and await rejoiner.check_start():
            self.on_event("alone", known_peers=len(rejoiner.peers))
        elif not config.rejoin_peers:  # a newcomer: a bootstrap peer's DHT, or exit
            await await_first_peer(rejoiner, self.network.dht_peer_count)
        self.network.every(REJOIN_TICK_S, rejoiner.tick)

    async def _start_gossip(self) -> None:
        await self.gossip.start()
        await self._poll()
        self.network.every(self._poll_period_s, self._poll)
        self.network.every(self.config.heartbeat_period_s, self._check_alignment)

    # ---- parameter anti-entropy (dht.realign) ------------------------------------------------

    async def _check_alignment(self) -> None:
        """Once a period: what the live peers' heartbeats say of their settled points, and a
        realignment in the background when the policy asks for one (one at a time)."""
        now = time.monotonic()
        own, peers = self._heartbeat_fn(), self.membership.alive_peers()
        self.realignment.observe(own, peers, now, self.replica.cosigned.counts())
        if self._realigning is not None:
            return
        decision = self.realignment.decide(now)
        if decision is not None:
            self.realignment.started(now, settle=decision.settle)
            self._realigning = self.network.spawn(self._realign(decision))

    async def realign_from_class(self, donor: str) -> bool:
        """Load `donor`'s state now, as `_realign` does, unless a realignment runs: a group
        member left out of its group's fetch round takes a class member's state
        (dht.realign_class decided it and bounds how often). Whether it loaded; returns once
        the retained updates were offered again the first time."""
        if self._realigning is not None:
            return False
        loaded: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._realigning = self.network.spawn(
            self._realign(Realign(donor, 0.0, group=True), loaded)
        )
        return await loaded

    async def _realign(self, decision: Realign, loaded: asyncio.Future[bool] | None = None) -> None:
        """Load the donor's state beside training (dht.state_transfer: the newcomer's checks),
        then offer the retained updates again: those the donor had not applied yet, this
        node's own among them, end up applied here too. `loaded` (when given) is told whether
        it loaded, once the retained updates were offered the first time."""
        ok = False
        try:
            ok = await self._load(decision)
        finally:
            if loaded is not None and not loaded.done():
                loaded.set_result(ok)
        if not ok:
            return
        await asyncio.sleep(RESUBMIT_AGAIN_PERIODS * self.config.heartbeat_period_s)
        if again := await self.resubmit_retained():
            self.on_event("realign_resubmitted", donor=decision.donor, resubmitted=again)

    async def _load(self, decision: Realign) -> bool:
        """`_realign`'s download, its events and the first offer of the retained updates."""
        if decision.group:
            logger.info("left out of my group's fetch round: taking class member %s's state",
                        decision.donor)  # fmt: skip
        elif decision.gap:
            logger.info(
                "%d update(s) lost here were applied by %s, which no longer holds them: "
                "taking its state", decision.gap, decision.donor,
            )  # fmt: skip
        else:
            logger.info(
                "settled point %.6f from %s's at one applied set: realigning%s",
                decision.distance, decision.donor, " (settle)" if decision.settle else "",
            )  # fmt: skip
        try:
            stats = await self.transfer.realign(decision.donor)
        finally:
            self._realigning = None
        self.realignment.finished(loaded=not isinstance(stats, StateRefusal))
        if isinstance(stats, StateRefusal):  # why: the check that refused it, or the stream
            self.on_event(
                "realign_refused", donor=decision.donor, distance=round(decision.distance, 9),
                settle=decision.settle, gap=decision.gap, group=decision.group,
                num_refused=self.realignment.num_refused, reason=stats.reason,
                check=stats.check, detail=stats.detail[:300], distances=stats.distances,
            )  # fmt: skip
            return False
        await asyncio.to_thread(self.on_realigned)
        lacking = await asyncio.get_running_loop().run_in_executor(
            self._merge_pool, lacking_retained, self.gossip.retained, self.replica
        )
        self.on_event(
            "realigned",
            donor=decision.donor,
            distance_before=round(decision.distance, 9),
            settle=decision.settle,
            gap=decision.gap,
            group=decision.group,
            agreed_by=stats.agreed_by,
            seconds=round(stats.seconds, 3),
            megabytes=round(stats.num_bytes / 1e6, 3),
            lacking=[list(uid) for uid in lacking[:MAX_LISTED]],
            num_lacking=len(lacking),
            num_realigned=self.realignment.num_realigned,
        )
        await self.resubmit_retained()
        return True

    async def resubmit_retained(self) -> int:
        """Merge the retained updates this replica lacks (after it adopted a donor's state),
        through the one path every update takes; how many were applied."""
        results = await asyncio.get_running_loop().run_in_executor(
            self._merge_pool, merge_retained, self.gossip.retained, self._pipeline
        )
        for result in results:
            if result.reason != "duplicate":
                self._on_merge(result)
        return sum(r.accepted for r in results)

    async def _poll(self) -> None:
        heartbeats = await self.membership.poll()
        # Off the loop: a first digest after a merge sorts the whole applied set, under the
        # replica's lock (later ones are cached until the applied set changes).
        own_digest = await asyncio.to_thread(self.replica.applied_digest)
        self.gossip.on_heartbeats(heartbeats, own_digest)

    @property
    def _poll_period_s(self) -> float:
        return min(1.0, self.config.heartbeat_period_s / 2)
