"""Fetching: an update CatchUp chose, asked of the peer it chose, checked, then merged (off the
loop) and retained for others. A learner group's update (its author a group key) is fetched
the same way and merged as one (dht.gossip_groups)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence

from dht.catchup import Fetch
from dht.gossip_context import GossipContext
from dht.gossip_groups import is_group_key, parse_fetched
from dht.grouping import member_check
from dht.grouping_wire import encode_update
from dht.lesser_served import LesserServed
from dht.reachability import path_rank
from dht.resumable import fetch_resumable, is_refusal
from dht.state_transfer import TransferStats
from dht.swarm_config import REQUEST_READ_TIMEOUT_S
from dht.transport import TooLargeError, TransportError
from merge.envelope import EnvelopeError, SignedUpdate
from merge.equivocation import Proof, UpdateId
from merge.group_equivocation import GroupProof
from merge.group_update import GroupUpdate
from merge.result import MergeResult

logger = logging.getLogger(__name__)
MAX_AUTHORS_JUDGED = 4096
"""Authors whose freshness the fetcher remembers (the most recently merged)."""
MAX_PENDING_JUDGEMENTS = 64
"""Authors whose freshness is being asked of the merge's ledger at once (off the loop)."""
MAX_AWAITED_SOURCES = 8
"""Peers asked in turn for the prevailing variant of a round whose lesser one was withdrawn
here (each serves its retained variant: the lesser one from a replica that applied it)."""


class Fetcher:
    """Fetches and merges one update at a time per `Fetch`; what a peer serves wrongly is
    counted against it, and a failed fetch goes back to CatchUp to try another source."""

    def __init__(
        self,
        context: GossipContext,
        *,
        on_evidence: Callable[[Proof | GroupProof | None], None],
        retain: Callable[[SignedUpdate], Awaitable[None]],
        retain_group: Callable[[GroupUpdate, bytes], Awaitable[None]],
    ) -> None:
        self._ctx = context
        self._on_evidence = on_evidence
        self._retain = retain
        self._retain_group = retain_group
        self.fetches: deque[TransferStats] = deque(maxlen=1000)
        """The last fetches' sizes and speeds (the dashboard's transfer figures)."""
        self._fresh: OrderedDict[str, bool] = OrderedDict()
        """Per author, whether the merge found it fresh after its latest update merged here."""
        self._refused: set[tuple[str, int]] = set()
        """Fetches in progress whose peer refused (not held): CatchUp asks it no more."""
        self.assemble: Callable[[UpdateId, Sequence[str]], Awaitable[GroupUpdate | None]] | None = (
            None
        )
        """A group update by its shards' holders where the asked peer holds it not whole
        (dht.group_exchange_assembly `assemble`; set where slices are served)."""
        self.lesser_served = LesserServed()
        """Holders that served a group round's lesser variant where it is wanted here."""
        self._judging: set[str] = set()
        """Authors whose freshness the merge's ledger is being asked (MAX_PENDING_JUDGEMENTS)."""
        context.catchup.source_rank = self.source_rank  # direct holders before relayed ones

    def source_rank(self, peer_id: str) -> int:
        """How promising `peer_id` is as a source, by this node's connection to it as last
        read from p2pd (dht.reachability.path_rank: direct 0, relayed 1, none 2)."""
        paths = getattr(self._ctx.network, "paths", None)
        return path_rank(paths.path(peer_id)) if paths is not None else 0

    def is_fresh(self, author: str) -> bool:
        """Whether `author` had no track record here when its latest update was merged (an
        author none of whose updates merged yet is fresh). Read on the loop: the merge's own
        `is_fresh_author` takes the replica's lock, which a merge holds for its whole apply.
        A learner group's key is fresh until one of its updates was applied here."""
        if is_group_key(author):
            return self._ctx.replica.last_seq(author) < 1
        fresh = self._fresh.get(author)
        if fresh is None:
            self._judge_later(author)
            return True
        return fresh

    def _judge_later(self, author: str) -> None:
        """An author none of whose updates this process merged is judged by the merge's
        ledger, off the loop, once; fresh until then. A restarted node's ledger (from its
        checkpoint or a downloaded state) knows the authors with a track record: without
        this every author was fresh after a restart until one of its updates merged here,
        all sharing the fresh authors' 2 fetch slots (bench.chaos --topology nat: the public
        node, back after 30 s, fetched a home's backlog only once two other homes'
        first updates had merged, and the home was killed with 4 updates nobody had)."""
        if author in self._judging or len(self._judging) >= MAX_PENDING_JUDGEMENTS:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # not on the loop (a test's direct call): stays fresh
        self._judging.add(author)
        self._ctx.network.spawn(self._judge(author))

    async def _judge(self, author: str) -> None:
        try:
            fresh = await self._ctx.off_loop(self._ctx.merge.is_fresh_author, author)
        finally:
            self._judging.discard(author)
        if author not in self._fresh:  # a merge's own verdict since then wins
            self._judged(author, fresh)
            self._ctx.kick()

    async def fetch_and_merge(self, fetch: Fetch) -> None:
        ctx, uid = self._ctx, fetch.update_id
        if is_group_key(fetch.author):
            await self._fetch_group(fetch)
            return
        update = await self._fetch_update(fetch)
        if update is None:
            self._failed(fetch)
            return
        result, fresh = await ctx.off_loop(self._submit, update)
        self._judged(update.header.author, fresh)
        ctx.catchup.fetched(uid)
        if result.reason == "equivocation":
            self._on_evidence(ctx.merge.evidence(update.signed_header))
        if result.reason != "duplicate":
            ctx.on_merge(result)
        if result.accepted:
            await self._retain(update)
        ctx.kick()

    async def _fetch_group(self, fetch: Fetch) -> None:
        """A learner group's update: parsed and matched to the id asked (a bad one counted
        against the peer that served it), merged as one unit (every member's signature and
        co-signature checked), retained and announced by this node's holder record."""
        ctx, uid = self._ctx, fetch.update_id
        data = await self._fetch_from(fetch.peer_id, fetch.author, fetch.seq, fetch.cause)
        if data is None and uid in self._refused and self.assemble is not None:
            # not held whole there: from its shards' holders, each shard checked (Session 28)
            whole = await self.assemble(uid, [fetch.peer_id])
            data = None if whole is None else encode_update(whole)
        parsed = None if data is None else parse_fetched(data, uid, ctx.replica.numel)
        if isinstance(parsed, str):
            ctx.reject(parsed, fetch.peer_id, "served a bad group update", update=False)
        if data is None or parsed is None or isinstance(parsed, str):
            self._failed(fetch)
            return
        in_group = member_check(ctx.config.run_id, fetch.author)
        result = await ctx.off_loop(ctx.merge.submit_group, parsed, in_group)
        if result.reason == "group_equivocation" and not await ctx.off_loop(
            ctx.replica.has_applied, *uid
        ):  # the lesser of a pair whose proof is known here: another holder may serve the other
            retry = self.lesser_served.served(uid)
            ctx.on_event("group_lesser_served", author=uid[0], seq=uid[1], peer=fetch.peer_id)
            if retry:
                ctx.catchup.failed(uid, fetch.peer_id, time.monotonic(), refused=True)
            else:
                logger.warning("group update %s#%d: only its lesser variant served", *uid)
                ctx.catchup.fetched(uid)
            ctx.kick()
            return
        if result.reason == "group_equivocation":  # a valid second variant: its proof goes on
            ctx.catchup.fetched(uid)
            self._on_evidence(await ctx.off_loop(ctx.merge.group_evidence, parsed))
            ctx.kick()
            return
        if not result.accepted and (result.reason or "").startswith("group_"):
            # Its signatures do not hold: the bytes this peer served, not the id, are bad
            # (no one signs a group update's id alone), so another holder is asked.
            ctx.reject("served_bad_group_update", fetch.peer_id, result.reason or "", update=False)
            ctx.catchup.failed(uid, fetch.peer_id, time.monotonic())
            ctx.kick()
            return
        ctx.catchup.fetched(uid)
        if result.reason != "duplicate":
            ctx.on_merge(result)
        if result.accepted:
            await self._retain_group(parsed, data)
        ctx.kick()

    def fetch_awaited_later(self, uid: UpdateId, sender: str | None) -> None:
        """`fetch_awaited` off the caller: a proof just withdrew the lesser variant of `uid`
        here (dht.gossip_evidence)."""
        if self._ctx.active:
            peers = [sender, *self._ctx.push_targets(exclude=sender)]
            sources = [p for p in peers if p is not None][:MAX_AWAITED_SOURCES]
            self._ctx.network.spawn(self._fetch_awaited(uid, sources))

    async def _fetch_awaited(self, uid: UpdateId, sources: list[str]) -> None:
        if not await self.fetch_awaited(uid, sources):
            logger.warning("group update %s#%d: its prevailing variant not found", *uid)

    async def fetch_awaited(self, uid: UpdateId, sources: list[str]) -> bool:
        """Fetches the prevailing variant of the group round `uid` whose lesser variant this
        replica withdrew, and merges it in that variant's slot (merge.group_pipeline). Catch-up
        wants no id in the applied set, and the withdrawn one stays there, so without this
        the replica would miss the round's step for good. `sources`, asked in turn: the
        proof's sender, then the peers a proof goes to (`fetch_awaited_later`); a peer serving
        the lesser variant is refused by the merge (no fault of the peer: it applied that one
        first), one serving bytes that do not parse is counted. True when the prevailing
        variant was merged here."""
        ctx = self._ctx
        in_group = member_check(ctx.config.run_id, uid[0])
        for peer in sources:
            data = await self._fetch_from(peer, *uid, "superseded")
            parsed = None if data is None else parse_fetched(data, uid, ctx.replica.numel)
            if isinstance(parsed, str):
                ctx.reject(parsed, peer, "served a bad group update", update=False)
            if data is None or parsed is None or isinstance(parsed, str):
                continue
            result = await ctx.off_loop(ctx.merge.submit_group, parsed, in_group)
            if result.reason == "duplicate":
                return False  # stepped here already (it came before the proof, or was pushed)
            if result.accepted:
                ctx.on_merge(result)
                await self._retain_group(parsed, data)
                ctx.kick()
                return True
        return False

    def _failed(self, fetch: Fetch) -> None:
        """Tells catch-up the fetch failed, and whether the peer refused (does not hold it)."""
        refused = fetch.update_id in self._refused
        self._refused.discard(fetch.update_id)
        self._ctx.catchup.failed(fetch.update_id, fetch.peer_id, time.monotonic(), refused=refused)
        self._ctx.kick()

    def _submit(self, update: SignedUpdate) -> tuple[MergeResult, bool]:
        """On the merge's thread: the update merged, and whether its author is fresh after."""
        merge = self._ctx.merge
        return merge.submit(update), merge.is_fresh_author(update.header.author)

    def _judged(self, author: str, fresh: bool) -> None:
        self._fresh[author] = fresh
        self._fresh.move_to_end(author)
        if len(self._fresh) > MAX_AUTHORS_JUDGED:
            self._fresh.popitem(last=False)

    async def _fetch_update(self, fetch: Fetch) -> SignedUpdate | None:
        """The update from `fetch.peer_id`, or None when it could not or would not give it."""
        data = await self._fetch_from(fetch.peer_id, fetch.author, fetch.seq, fetch.cause)
        if data is None:
            return None
        try:
            update = SignedUpdate.from_bytes(data)
        except EnvelopeError as exc:
            self._ctx.reject(exc.reason, fetch.peer_id, str(exc), seq=fetch.seq)
            return None
        if update.header.update_id != fetch.update_id:
            self._ctx.reject("malformed", fetch.peer_id, "served another update", seq=fetch.seq)
            return None
        return update

    async def fetch_bytes(self, peer_id: str, author: str, seq: int, cause: str) -> bytes | None:
        """The wire bytes of (author, seq) from `peer_id`, unchecked, or None; `cause`: why
        (the update_fetched event's; no default: an unnamed cause would mislabel the fetch)."""
        return await self._fetch_from(peer_id, author, seq, cause)

    async def _fetch_from(self, peer_id: str, author: str, seq: int, cause: str) -> bytes | None:
        ctx = self._ctx
        if peer_id == ctx.peer_id:
            return None
        started = time.perf_counter()
        try:
            # In as many streams as the path needs: a relay may cut each (dht.resumable).
            async with asyncio.timeout(ctx.transfer_timeout_s):
                data, num_attempts = await fetch_resumable(
                    lambda: ctx.network.open_stream(peer_id, "update"),
                    [author, seq],
                    max_bytes=ctx.config.max_update_bytes,
                    stall_timeout_s=REQUEST_READ_TIMEOUT_S,
                )
        except TooLargeError as exc:
            ctx.reject("too_large", peer_id, str(exc), seq=seq, update=peer_id == author)
            if peer_id == author:  # what its signed header names will not shrink: settled
                ctx.catchup.fetched((author, seq))
            return None
        except (TimeoutError, TransportError, OSError, ValueError) as exc:
            logger.debug("fetching %s/%d from %s failed: %s", author, seq, peer_id, exc)
            if is_refusal(exc):
                self._refused.add((author, seq))
            return None
        stats = TransferStats(len(data), time.perf_counter() - started, peer_id)
        path = await ctx.network.path_to(peer_id)  # the connection the fetch just used
        self._report(stats, author, seq, num_attempts, path, cause)
        return data

    def _report(
        self,
        stats: TransferStats,
        author: str,
        seq: int,
        num_attempts: int,
        path: str | None,
        cause: str,
    ) -> None:
        self.fetches.append(stats)
        self._ctx.on_event(
            "update_fetched",
            author=author,
            seq=seq,
            peer_id=stats.peer_id,
            megabytes=round(stats.num_bytes / 1e6, 3),
            seconds=round(stats.seconds, 4),
            mb_per_s=round(stats.mb_per_s, 2),
            num_attempts=num_attempts,
            path=path,
            cause=cause,
        )
