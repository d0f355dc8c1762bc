"""Repair: with a peer whose applied digest differs, exchange per-author summaries (applied and
retained seq ranges) and want what the peer names and this node lacks, within bounds."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from dht.budget import PeerBudget, StreamLimits
from dht.gossip_context import GossipContext
from dht.gossip_groups import group_ceilings
from dht.ranges import to_ranges
from dht.summary_bounds import ReducedSummary, SummaryLimits, reduce_summary, take_ids
from dht.swarm_config import REQUEST_READ_TIMEOUT_S
from dht.transport import TooLargeError, TransportError, encode_request, receive_blob, send_blob

logger = logging.getLogger(__name__)
MAX_SUMMARY_BYTES = 1 << 20
SUMMARY_BOUNDS = SummaryLimits()
"""What one summary may make this node want (dht.summary_bounds)."""
SUMMARY_IDS_PER_S = 512.0
"""Update ids a peer's summaries may make this node want per second, on average..."""
SUMMARY_IDS_BURST = 8192.0
"""...and at once after a quiet spell (a newcomer's first repair)."""
SUMMARY_LIMITS = StreamLimits(rate_per_s=1.0, burst=8.0, max_in_flight=2, deadline_s=20.0)
"""Summary exchanges a peer may start (an honest one: one per summary period while digests
differ)."""


class Repair:
    """Summary exchanges, both ends: what a peer's summary names is bounded by SUMMARY_BOUNDS
    and the peer's budget of ids per second before CatchUp wants any of it; what is refused is
    counted against the peer."""

    def __init__(self, context: GossipContext) -> None:
        self._ctx = context
        self._summary_budget = PeerBudget(rate_per_s=SUMMARY_IDS_PER_S, burst=SUMMARY_IDS_BURST)
        """Update ids each peer's summaries may make this node want (its work per second)."""
        self.on_unreachable: Callable[[str, int, float], None] = lambda *_: None
        """(peer, ids it applied that are lost here and it does not hold, now) after each of
        its summaries, 0 included: dht.realign's gap (the swarm sets it)."""

    def compare_notes(self, own_digest: str) -> None:
        """Exchange summaries with the live peers CatchUp picks among those whose applied
        digest differs from `own_digest`."""
        ctx = self._ctx
        digests = {h.peer_id: h.applied_digest for h in ctx.membership.alive_peers()}
        contributed = {p for p in digests if ctx.replica.last_seq(p) >= 1}
        now = time.monotonic()
        for peer_id in ctx.catchup.summary_peers(now, own_digest, digests, contributed):
            ctx.network.spawn(self._exchange_summaries(peer_id))

    def _summary(self) -> bytes:
        """This node's applied and retained ranges (off the loop: O(applied set))."""
        applied = to_ranges(self._ctx.replica.applied)
        retained: dict[str, list[int]] = {}
        for author, seq in self._ctx.retained.ids():
            retained.setdefault(author, []).append(seq)
        return encode_request(applied=applied, retained=to_ranges(retained))

    def _ceilings(self) -> dict[str, int]:
        """Per author, the highest seq this node has evidence of (applied, in a signed header
        it checked, or announced in the author's own live heartbeat): how far a peer's
        summary may name that author's ids (+ slack). An author's heartbeat can raise only
        its own ceiling, and the caps bound what that costs."""
        ceilings = self._ctx.catchup.seen_seqs()
        for heartbeat in self._ctx.membership.alive_peers():
            author = heartbeat.peer_id
            ceilings[author] = max(ceilings.get(author, 0), heartbeat.latest_seq)
        return ceilings

    def _reduce_summary(self, blob: bytes, ceilings: dict[str, int]) -> ReducedSummary:
        """Off the loop: O(the summary's ranges + this node's applied set), never O(ids).
        Learner groups' keys it names are bounded by the highest group seq known here
        (dht.gossip_groups.group_ceilings): a group key new after a regrouping has no
        evidence of its own."""
        own = to_ranges(self._ctx.replica.applied)
        return reduce_summary(blob, own, ceilings, SUMMARY_BOUNDS, derive=group_ceilings)

    async def _learn_summary(self, peer_id: str, blob: bytes) -> int:
        """Wants what a peer's summary names and this node lacks, within SUMMARY_BOUNDS and
        the peer's budget of ids per second; what is refused is counted against the peer."""
        ctx = self._ctx
        reduced = await asyncio.to_thread(self._reduce_summary, blob, self._ceilings())
        applied, retained = reduced.applied, reduced.retained
        beyond, over_cap = reduced.num_beyond, reduced.num_over_cap
        if beyond:
            ctx.reject("summary_beyond_seq", peer_id, f"{beyond} ids past seqs", update=False)
        num_named = sum(hi - lo + 1 for runs in applied.values() for lo, hi in runs)
        granted = self._summary_budget.take(peer_id, num_named, time.monotonic())
        if granted < num_named:
            detail = f"{num_named - granted} ids over its budget per second"
            ctx.reject("summary_over_budget", peer_id, detail, update=False)
            applied = take_ids(applied, granted)
        view = ctx.membership.peers.get(peer_id)
        serves_state = view is not None and view.heartbeat.serves_state  # the gap's donor
        now = time.monotonic()
        learned = ctx.catchup.summary(peer_id, applied, retained, now, serves_state=serves_state)
        self.on_unreachable(peer_id, learned.num_unreachable, now)
        if over_cap or learned.num_capped:
            detail = f"{over_cap + learned.num_capped} ids over its caps"
            ctx.reject("summary_over_cap", peer_id, detail, update=False)
        if learned.num_new:
            num_new = learned.num_new
            logger.info("repair: %d updates to fetch after comparing with %s", num_new, peer_id)
            ctx.on_event("repair", peer_id=peer_id, num_missing=num_new)
            ctx.kick()
        return learned.num_new

    async def _exchange_summaries(self, peer_id: str) -> None:
        try:
            answer = await self._ctx.network.exchange(
                peer_id,
                "summary",
                await asyncio.to_thread(self._summary),
                max_bytes=MAX_SUMMARY_BYTES,
                timeout_s=SUMMARY_LIMITS.deadline_s,
            )
            await self._learn_summary(peer_id, answer)
        except TooLargeError as exc:
            self._ctx.reject("summary_too_large", peer_id, str(exc), update=False)
        except (TimeoutError, TransportError, OSError) as exc:
            logger.debug("summary exchange with %s failed: %s", peer_id, exc)
        except ValueError as exc:
            self._ctx.reject("bad_summary", peer_id, str(exc))

    async def rpc_summary(self, info: Any, reader: Any, writer: Any) -> None:
        ctx, peer_id = self._ctx, str(info.peer_id)
        try:
            request = await receive_blob(
                reader, max_bytes=MAX_SUMMARY_BYTES, stall_timeout_s=REQUEST_READ_TIMEOUT_S
            )
            await send_blob(writer, await asyncio.to_thread(self._summary))
            if ctx.active and ctx.membership.is_alive(peer_id):  # no state for strangers
                await self._learn_summary(peer_id, request)
        except TooLargeError as exc:
            ctx.reject("summary_too_large", peer_id, str(exc), update=False)
        except (TransportError, OSError, TimeoutError) as exc:
            logger.debug("summary request from %s failed: %s", peer_id, exc)
        except ValueError as exc:
            ctx.reject("bad_summary", peer_id, str(exc))
