"""Gossip: announce this node's updates, fetch and merge peers' updates, serve retained ones.

A small coordinator over one part per concern, all sharing a GossipContext:
announcements (dht.gossip_announce), headers heard (dht.gossip_headers), fetching
(dht.gossip_fetch), repair by summaries (dht.gossip_repair), proofs of equivocation
(dht.gossip_evidence) and serving retained updates (dht.gossip_serve). What to fetch, from
whom and what counts as lost is decided by `CatchUp` (pure); the pump here acts on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from dht.catchup import CatchUp, CatchUpConfig
from dht.gossip_announce import Announcements
from dht.gossip_context import GossipContext
from dht.gossip_evidence import EVIDENCE_LIMITS, Evidence
from dht.gossip_fetch import Fetcher
from dht.gossip_groups import group_update_id, offer_in_bounds
from dht.gossip_headers import NOTIFY_LIMITS, Headers
from dht.gossip_repair import SUMMARY_LIMITS, Repair
from dht.gossip_serve import UpdateServer, update_limits
from dht.grouping_wire import encode_update
from dht.heartbeat import Heartbeat
from dht.membership import Membership
from dht.merge_port import MergePort
from dht.network import SwarmNetwork
from dht.network_streams import Handler
from dht.rejections import Rejections
from dht.retention import RetainedUpdates
from dht.state_transfer import TransferStats
from dht.swarm_config import SwarmConfig
from merge.envelope import SignedUpdate
from merge.group_update import GroupUpdate
from merge.result import MergeResult

logger = logging.getLogger(__name__)


class Gossip:
    """Moves signed updates between peers: push notifications, DHT announcements, fetches,
    and repair by comparing applied digests and exchanging per-author summaries."""

    def __init__(
        self,
        network: SwarmNetwork,
        membership: Membership,
        merge: MergePort,
        *,
        merge_pool: Executor,
        reject: Rejections,
        on_merge: Callable[[MergeResult], None],
        on_event: Callable[..., None],
    ) -> None:
        config = network.config
        self._ctx = ctx = GossipContext(
            network=network,
            membership=membership,
            merge=merge,
            catchup=CatchUp(catchup_config(config), network.peer_id, merge.replica),
            retained=retained_updates(config),
            merge_pool=merge_pool,
            reject=reject,
            on_merge=on_merge,
            on_event=on_event,
        )
        self.evidence = Evidence(ctx)
        self.headers = Headers(ctx, self.evidence.on_evidence)
        self.announcements = Announcements(ctx, self.headers.on_header)
        self.fetcher = Fetcher(
            ctx,
            on_evidence=self.evidence.on_evidence,
            retain=self.announcements.retain,
            retain_group=self.retain_group,
        )
        self.evidence.on_superseded = self.fetcher.fetch_awaited_later
        ctx.catchup.is_fresh = self.fetcher.is_fresh  # fresh authors' fetches come last, capped
        self.repair = Repair(ctx)
        # The stream handlers register() serves (attributes: a bench adversary swaps one).
        self.rpc_update: Handler = UpdateServer(ctx.retained).rpc_update
        self.rpc_notify: Handler = self.headers.rpc_notify
        self.rpc_summary: Handler = self.repair.rpc_summary
        self.rpc_evidence: Handler = self.evidence.rpc_evidence

    # ---- what the swarm reads ---------------------------------------------------------------

    @property
    def active(self) -> bool:
        return self._ctx.active

    @property
    def catchup(self) -> CatchUp:
        return self._ctx.catchup

    @property
    def retained(self) -> RetainedUpdates:
        return self._ctx.retained

    @property
    def fetches(self) -> deque[TransferStats]:
        return self.fetcher.fetches

    @property
    def num_lost(self) -> int:
        """Updates this node knows exist but that no live peer could give it."""
        return len(self._ctx.catchup.lost)

    @property
    def num_need_state(self) -> int:
        """Updates no live peer serves that a live peer's state brings (not lost)."""
        return self._ctx.catchup.num_need_state

    # ---- what the swarm calls -----------------------------------------------------------------

    async def register(self) -> None:
        network = self._ctx.network
        limits = update_limits(self._ctx.transfer_timeout_s)
        await network.add_handler("update", self.rpc_update, limits)
        await network.add_handler("notify", self.rpc_notify, NOTIFY_LIMITS)
        await network.add_handler("summary", self.rpc_summary, SUMMARY_LIMITS)
        await network.add_handler("evidence", self.rpc_evidence, EVIDENCE_LIMITS)

    async def start(self) -> None:
        self._ctx.active = True
        self._ctx.wake = asyncio.Event()
        self._ctx.network.spawn(self._pump())

    def on_heartbeats(self, heartbeats: list[Heartbeat], own_digest: str) -> None:
        """Settle the pushes held for unknown peers; look up announcements of authors ahead
        of us; compare notes with peers whose applied set differs from ours (`own_digest`,
        computed off the loop by the caller)."""
        if not self._ctx.active:
            return
        self.headers.settle_deferred()
        self.announcements.look_up_ahead(heartbeats)
        self.repair.compare_notes(own_digest)
        self._ctx.kick()

    def forget_peer(self, peer_id: str) -> None:
        """`peer_id` left: release what was kept for it (its applied updates stay applied)."""
        self.announcements.forget_peer(peer_id)
        self._ctx.catchup.forget_peer(peer_id)

    async def publish(self, update: SignedUpdate) -> None:
        await self.announcements.publish(update)

    async def retain_group(self, update: GroupUpdate, blob: bytes | None = None) -> None:
        """A learner group's update this node holds (merged, or completed as a member):
        retained to serve under its id and announced in this node's holder record of its
        group key, so a peer that missed its push fetches it here (dht.gossip_groups).
        `blob`: its wire bytes when at hand."""
        blob = encode_update(update) if blob is None else blob
        await self.announcements.retain_blob(group_update_id(update), blob)

    def offer_group(self, author: str, seq: int, holder: str, cause: str = "notice") -> bool:
        """A learner group's update `holder` completed (its group-done notice): wanted from it,
        fetched once by catch-up and merged as one unit (dht.gossip_fetch), unless applied or
        wanted already; False (counted) for a seq past what this node knows + slack.
        `cause`: why it is offered (the update_fetched event's; the shard fetch's hand-over
        names its reason, dht.group_exchange_candidates)."""
        ctx = self._ctx
        known = ctx.catchup.seen_seqs()
        known[author] = max(known.get(author, 0), ctx.replica.last_seq(author))
        if not offer_in_bounds(known, author, seq):
            ctx.reject("group_done_too_far", holder, f"{author}/{seq}", update=False)
            return False
        if ctx.catchup.announced(author, seq, None, time.monotonic(), holder=holder, cause=cause):
            ctx.kick()
        return True

    async def fetch_group(
        self, peer_id: str, author: str, seq: int, cause: str = "adopt"
    ) -> bytes | None:
        """A learner group's update's wire bytes from `peer_id` (its member that completed it),
        or None (counted in update_fetched as any fetch, with `cause`: a member adopting its
        own round's update, or the shard fetch's in-order fallback names its reason)."""
        return await self.fetcher.fetch_bytes(peer_id, author, seq, cause)

    async def announced_seq(self, author: str) -> int:
        """The highest seq `author` announced that the DHT still holds (0 if none)."""
        return await self.announcements.announced_seq(author)

    # ---- the pump: act on CatchUp's decisions ----------------------------------------------

    async def _pump(self) -> None:
        wake = self._ctx.wake
        assert wake is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=self._pump_period_s)
            wake.clear()
            self._step()

    @property
    def _pump_period_s(self) -> float:
        return min(1.0, self._ctx.config.heartbeat_period_s / 2)

    def _step(self) -> None:
        ctx, now = self._ctx, time.monotonic()
        alive = {h.peer_id for h in ctx.membership.alive_peers()}
        for author, seq in ctx.catchup.declare_lost(now, alive):
            ctx.on_event("update_lost", author=author, seq=seq, num_lost=self.num_lost)
            logger.warning("update %s#%d is lost: no live peer holds it", author, seq)
        for author, seq in ctx.catchup.newly_need_state:
            ctx.on_event("update_needs_state", author=author, seq=seq, num=self.num_need_state)
            logger.info(
                "update %s#%d: no live peer holds it, a peer's state brings it", author, seq
            )
        ctx.catchup.newly_need_state.clear()
        for gap in ctx.catchup.newly_stalled:
            ctx.on_event(
                "catchup_stalled",
                gap_s=round(gap, 3),
                num_stalls=ctx.catchup.num_stalls,
                stalled_s=round(ctx.catchup.stalled_s, 3),
            )
            logger.info("this node did not run for %.1f s: its catch-up waits move on by it", gap)
        ctx.catchup.newly_stalled.clear()
        for author in ctx.catchup.holder_lookups(now, alive):
            self.announcements.look_up_holders(author)
        for fetch in ctx.catchup.next_fetches(now, alive):
            ctx.network.spawn(self.fetcher.fetch_and_merge(fetch))
        deferred = Counter(author for author, _ in ctx.catchup.newly_deferred)
        ctx.catchup.newly_deferred.clear()
        for author, n in deferred.items():
            ctx.reject.count_many("fetch_deferred", author, n, "a fresh author over its fetch cap")


def catchup_config(config: SwarmConfig) -> CatchUpConfig:
    """CatchUp's timings, sized to the heartbeat period."""
    period = config.heartbeat_period_s
    return CatchUpConfig(
        lost_after_s=config.gap_wait_s,
        retry_s=min(2.0, period),
        stall_s=3 * period,  # a node stalled as long as peers call it dead: its waits stop too
        mismatch_grace_s=2 * period,
        summary_period_s=2 * period,
    )


def retained_updates(config: SwarmConfig) -> RetainedUpdates:
    """The retained copies, within the configured count per author and memory budget."""
    return RetainedUpdates(
        per_author=config.retain_updates,
        budget_bytes=config.retain_bytes,
        spill_dir=Path(config.spill_dir) if config.spill_dir else None,
    )
