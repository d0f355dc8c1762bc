"""Gossip: announce this node's updates, fetch and merge peers' updates, serve retained ones."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from dht.budget import PeerBudget, StreamLimits
from dht.catchup import CatchUp, CatchUpConfig, Fetch, to_ranges
from dht.deferred import DeferredNotifies
from dht.heartbeat import Heartbeat
from dht.membership import Membership, SeenSet
from dht.messages import (
    MAX_SEQ,
    MAX_SIGNED_HEADER_BYTES,
    MessageError,
    announcement_subkey,
    holder_subkey,
    parse_announced_seq,
    parse_holder,
    parse_signed_header,
)
from dht.network import (
    MIN_LINK_BYTES_PER_S,
    REQUEST_READ_TIMEOUT_S,
    Rejections,
    SwarmNetwork,
)
from dht.records import subkey_owner
from dht.resumable import fetch_resumable, parse_part_request, part_answer
from dht.retention import RetainedUpdates
from dht.state_transfer import TransferStats
from dht.summary_bounds import (
    ReducedSummary,
    SummaryLimits,
    reduce_summary,
    take_ids,
)
from dht.transport import (
    TooLargeError,
    TransportError,
    decode_request,
    encode_request,
    receive_blob,
    send_blob,
    send_refusal,
)
from merge.envelope import EnvelopeError, SignedHeader, SignedUpdate, UpdateHeader
from merge.equivocation import MAX_PROOF_BYTES, Proof, ProofError
from merge.pipeline import MergeResult, UpdatePipeline

logger = logging.getLogger(__name__)
MAX_SUMMARY_BYTES = 1 << 20
SUMMARY_BOUNDS = SummaryLimits()
"""What one summary may make this node want (dht.summary_bounds)."""
SUMMARY_IDS_PER_S = 512.0
"""Update ids a peer's summaries may make this node want per second, on average..."""
SUMMARY_IDS_BURST = 8192.0
"""...and at once after a quiet spell (a newcomer's first repair)."""
NOTIFY_LIMITS = StreamLimits(rate_per_s=20.0, burst=64.0, max_in_flight=4, deadline_s=10.0)
"""Pushed headers a peer may send (an honest one sends one a round)."""
SUMMARY_LIMITS = StreamLimits(rate_per_s=1.0, burst=8.0, max_in_flight=2, deadline_s=20.0)
"""Summary exchanges a peer may start (an honest one: one per summary period while digests
differ)."""
EVIDENCE_LIMITS = StreamLimits(rate_per_s=2.0, burst=16.0, max_in_flight=2, deadline_s=10.0)
"""Proofs of equivocation a peer may push (an honest one passes on each proof once)."""
MAX_PUSH_NEWCOMERS = 8
"""Live peers without a contribution yet that each published header is pushed to."""
MAX_LOOKUPS = 64
"""DHT lookups (announcements, holders) running at once."""
MAX_LOOKUPS_PER_POLL = 8
"""Announcement lookups started per membership poll."""
MAX_ANNOUNCEMENTS_PER_LOOKUP = 64
"""Announced headers of one author whose signatures one lookup checks (lowest unknown seqs)."""
UPDATE_RATE_PER_S = 20.0
"""Update fetches a peer may start per second (an honest one fetches each update once)."""
UPDATE_BURST = 128.0
UPDATE_IN_FLIGHT = 4


class Gossip:
    """Moves signed updates between peers: push notifications, DHT announcements, fetches,
    and repair by comparing applied digests and exchanging per-author summaries.

    What to fetch, from whom and what counts as lost is decided by `CatchUp` (pure); this
    class only does the talking.
    """

    def __init__(
        self,
        network: SwarmNetwork,
        membership: Membership,
        pipeline: UpdatePipeline,
        *,
        merge_pool: Executor,
        reject: Rejections,
        on_merge: Callable[[MergeResult], None],
        on_event: Callable[..., None],
    ) -> None:
        self.network = network
        self.config = network.config
        self.peer_id = network.peer_id
        self.membership = membership
        self.pipeline = pipeline
        self.replica = pipeline.replica
        self.fetches: deque[TransferStats] = deque(maxlen=1000)
        self.active = False
        self.catchup = CatchUp(self._catchup_config(), self.peer_id, self.replica)
        self._merge_pool = merge_pool
        self._reject = reject
        self._on_merge = on_merge
        self._on_event = on_event
        self.retained = RetainedUpdates(
            per_author=self.config.retain_updates,
            budget_bytes=self.config.retain_bytes,
            spill_dir=Path(self.config.spill_dir) if self.config.spill_dir else None,
        )
        self._lookups: dict[str, asyncio.Task[None]] = {}
        self._looked_up: dict[str, int] = {}
        self._wake: asyncio.Event | None = None
        self._bad_records = SeenSet(4096)
        self._deferred = DeferredNotifies()
        """Pushed headers of peers whose heartbeat is not read yet (dht.deferred)."""
        self._summary_budget = PeerBudget(rate_per_s=SUMMARY_IDS_PER_S, burst=SUMMARY_IDS_BURST)
        """Update ids each peer's summaries may make this node want (its work per second)."""

    def _catchup_config(self) -> CatchUpConfig:
        period = self.config.heartbeat_period_s
        return CatchUpConfig(
            lost_after_s=self.config.gap_wait_s,
            retry_s=min(2.0, period),
            mismatch_grace_s=2 * period,
            summary_period_s=2 * period,
        )

    @property
    def num_lost(self) -> int:
        """Updates this node knows exist but that no live peer could give it."""
        return len(self.catchup.lost)

    async def register(self) -> None:
        update_limits = StreamLimits(
            rate_per_s=UPDATE_RATE_PER_S,
            burst=UPDATE_BURST,
            max_in_flight=UPDATE_IN_FLIGHT,
            deadline_s=self._transfer_timeout_s,
        )
        await self.network.add_handler("update", self.rpc_update, update_limits)
        await self.network.add_handler("notify", self.rpc_notify, NOTIFY_LIMITS)
        await self.network.add_handler("summary", self.rpc_summary, SUMMARY_LIMITS)
        await self.network.add_handler("evidence", self.rpc_evidence, EVIDENCE_LIMITS)

    async def start(self) -> None:
        self.active = True
        self._wake = asyncio.Event()
        self.network.spawn(self._pump())

    def on_heartbeats(self, heartbeats: list[Heartbeat], own_digest: str) -> None:
        """Settle the pushes held for unknown peers; look up announcements of authors ahead
        of us; compare notes with peers whose applied set differs from ours (`own_digest`,
        computed off the loop by the caller)."""
        if not self.active:
            return
        read_started = self.membership.last_read_started
        if read_started is not None and len(self._deferred):
            settled = self._deferred.after_read(read_started, self.membership.is_alive)
            for sender in settled.refused:
                self._reject_unknown(sender)
            for signed in settled.accepted:
                self._on_header(signed)
        started = 0
        # Contributors first: a flood of fresh keys claiming seqs waits behind them, and costs
        # at most MAX_LOOKUPS_PER_POLL DHT reads a poll (the rest are looked up later).
        for heartbeat in sorted(heartbeats, key=lambda h: self.replica.last_seq(h.peer_id) < 1):
            author = heartbeat.peer_id
            known = max(self.catchup.max_seen(author), self.replica.last_seq(author))
            if heartbeat.latest_seq > max(known, self._looked_up.get(author, 0)):
                if started >= MAX_LOOKUPS_PER_POLL or self._lookups_in_flight() >= MAX_LOOKUPS:
                    break
                self._looked_up[author] = heartbeat.latest_seq
                self._lookup(author, self._lookup_announcements(author))
                started += 1
        digests = {h.peer_id: h.applied_digest for h in self.membership.alive_peers()}
        contributed = {p for p in digests if self.replica.last_seq(p) >= 1}
        now = time.monotonic()
        for peer_id in self.catchup.summary_peers(now, own_digest, digests, contributed):
            self.network.spawn(self._exchange_summaries(peer_id))
        self._kick()

    def _reject_unknown(self, sender: str) -> None:
        self._reject("notify_unknown_peer", sender, "no live heartbeat", update=False)

    def forget_peer(self, peer_id: str) -> None:
        """`peer_id` left: release what was kept for it (its applied updates stay applied)."""
        self._looked_up.pop(peer_id, None)
        for key in (peer_id, f"holders/{peer_id}"):
            task = self._lookups.get(key)
            if task is not None and task.done():
                del self._lookups[key]
        self.catchup.forget_peer(peer_id)

    # ---- the pump: act on CatchUp's decisions ----------------------------------------------

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _pump(self) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._pump_period_s)
            self._wake.clear()
            self._step()

    @property
    def _pump_period_s(self) -> float:
        return min(1.0, self.config.heartbeat_period_s / 2)

    def _step(self) -> None:
        now = time.monotonic()
        alive = {h.peer_id for h in self.membership.alive_peers()}
        for author, seq in self.catchup.declare_lost(now, alive):
            self._on_event("update_lost", author=author, seq=seq, num_lost=self.num_lost)
            logger.warning("update %s#%d is lost: no live peer holds it", author, seq)
        for author in self.catchup.holder_lookups(now, alive):
            self._lookup(f"holders/{author}", self._lookup_holders(author))
        for fetch in self.catchup.next_fetches(now, alive):
            self.network.spawn(self._fetch_and_merge(fetch))

    def _lookup(self, key: str, coro: Coroutine[Any, Any, None]) -> None:
        """One DHT lookup per key at a time; finished ones are dropped (the map stays small)."""
        task = self._lookups.get(key)
        if task is not None and not task.done():
            coro.close()
            return
        if len(self._lookups) >= MAX_LOOKUPS:
            self._lookups = {k: t for k, t in self._lookups.items() if not t.done()}
        self._lookups[key] = self.network.spawn(coro)

    def _lookups_in_flight(self) -> int:
        return sum(not task.done() for task in self._lookups.values())

    # ---- what the node hears ----------------------------------------------------------------

    def _on_header(self, signed: SignedHeader) -> None:
        header = signed.header
        reason = self.pipeline.check_header(signed)
        if reason == "duplicate":
            return
        if reason is not None:
            self._reject(reason, header.author, "header check failed", seq=header.seq)
            if reason == "equivocation":
                self._on_evidence(self.pipeline.evidence(signed))
            if reason != "bad_signature":  # a forged header says nothing of the real update
                self.catchup.fetched(header.update_id)  # settled: not worth fetching
            return
        if self.catchup.announced(header.author, header.seq, signed, time.monotonic()):
            self._kick()

    async def _lookup_announcements(self, author: str) -> None:
        """The author's announced headers this node does not know yet, the lowest
        MAX_ANNOUNCEMENTS_PER_LOOKUP seqs first: an author storing a hundred thousand subkeys
        costs a bounded number of signature checks per lookup (the rest come in later ones)."""
        announced = await self.network.dht_get(f"{self.config.prefix}/updates/{author}")
        unknown = []
        for subkey, blob in announced.items():
            seq = self._announced_seq(author, subkey, blob)
            if seq is not None and not self.catchup.knows((author, seq)):
                unknown.append((seq, subkey, blob))
        unknown.sort(key=lambda entry: entry[0])
        if len(unknown) > MAX_ANNOUNCEMENTS_PER_LOOKUP:
            del unknown[MAX_ANNOUNCEMENTS_PER_LOOKUP:]
            self._looked_up[author] = unknown[-1][0]  # the next poll looks up the rest
        for seq, subkey, blob in unknown:
            signed = self._parse_header_record(author, seq, subkey, blob)
            if signed is not None:
                self._on_header(signed)

    async def _lookup_holders(self, author: str) -> None:
        holders = await self.network.dht_get(f"{self.config.prefix}/holders/{author}")
        now = time.monotonic()
        for subkey, value in holders.items():
            try:
                record = parse_holder(subkey, value)
            except MessageError as exc:
                self._reject_record(f"holder_{exc.reason}", subkey, value, str(exc))
                continue
            self.catchup.holders(author, record.seq, [record.holder], now)
        self._kick()

    def _announced_seq(self, author: str, subkey: object, blob: object) -> int | None:
        """The seq an announcement's subkey names (only `author` can write under its key:
        owner subkeys); a bad subkey counted once against its writer."""
        try:
            return parse_announced_seq(subkey, author)
        except MessageError as exc:
            self._reject_record(f"announcement_{exc.reason}", subkey, blob, str(exc))
            return None

    def _parse_header_record(
        self, author: str, seq: int, subkey: object, blob: object
    ) -> SignedHeader | None:
        """The header an announcement holds: still the author's, signed, with the seq its
        subkey names; a bad one counted once against the author, as its bad update."""
        try:
            return parse_signed_header(blob, author=author, seq=seq)
        except MessageError as exc:
            # The author's own record (owner-signed): a bad header in it is its bad update.
            self._reject_record(exc.reason, subkey, blob, str(exc), seq=seq)
            return None

    def _reject_record(
        self, reason: str, subkey: object, value: object, detail: str, *, seq: int | None = None
    ) -> None:
        """A bad DHT entry is counted once (not on every lookup), against the peer owning it;
        with `seq`, as that peer's rejected update."""
        fingerprint = hash((str(subkey), value if isinstance(value, bytes) else repr(value)))
        if self._bad_records.add(fingerprint):
            writer = subkey_owner(subkey) or str(subkey)[:128]
            self._reject(reason, writer, detail, seq=seq, update=seq is not None)

    async def _fetch_and_merge(self, fetch: Fetch) -> None:
        uid = fetch.update_id
        update = await self._fetch_update(fetch)
        if update is None:
            self.catchup.failed(uid, fetch.peer_id, time.monotonic())
            self._kick()
            return
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._merge_pool, self.pipeline.submit, update)
        self.catchup.fetched(uid)
        if result.reason == "equivocation":
            self._on_evidence(self.pipeline.evidence(update.signed_header))
        if result.reason != "duplicate":
            self._on_merge(result)
        if result.accepted:
            await self._retain(update)
        self._kick()

    async def _fetch_update(self, fetch: Fetch) -> SignedUpdate | None:
        """The update from `fetch.peer_id`, or None when it could not or would not give it."""
        data = await self._fetch_from(fetch.peer_id, fetch.author, fetch.seq)
        if data is None:
            return None
        try:
            update = SignedUpdate.from_bytes(data)
        except EnvelopeError as exc:
            self._reject(exc.reason, fetch.peer_id, str(exc), seq=fetch.seq)
            return None
        if update.header.update_id != fetch.update_id:
            self._reject("malformed", fetch.peer_id, "served another update", seq=fetch.seq)
            return None
        return update

    # ---- equivocation: proofs settled here and passed on -----------------------------------

    def _on_evidence(self, proof: Proof | None, sender: str | None = None) -> None:
        """Settle a proof off the loop (it may withdraw an applied update), then pass it on."""
        if proof is not None and self.active:
            self.network.spawn(self._settle(proof, sender))

    async def _settle(self, proof: Proof, sender: str | None) -> None:
        loop = asyncio.get_running_loop()
        action = await loop.run_in_executor(
            self._merge_pool, self.pipeline.learn_proof, proof, self._retained_update
        )
        self.catchup.fetched(proof.update_id)
        if action == "none":
            return
        author, seq = proof.update_id
        self._on_event("equivocation_proven", author=author, seq=seq, action=action)
        blob = proof.to_bytes()
        peers = self._push_targets(exclude=sender)
        await asyncio.gather(
            *(self.network.send(p, "evidence", blob, timeout_s=5.0) for p in peers),
            return_exceptions=True,
        )

    def _retained_update(self, header: UpdateHeader) -> SignedUpdate | None:
        """The update applied here under `header`'s id, from the retained copies (off the loop)."""
        data = self.retained.get(header.update_id)
        if data is None:
            return None
        try:
            return SignedUpdate.from_bytes(data)
        except EnvelopeError:
            return None

    async def rpc_evidence(self, info: Any, reader: Any, writer: Any) -> None:
        """A pushed proof of equivocation: checked (both signatures, this run) before anything
        is done with it; a bad one is counted against its sender."""
        sender = str(info.peer_id)
        try:
            blob = await asyncio.wait_for(
                receive_blob(reader, max_bytes=MAX_PROOF_BYTES), REQUEST_READ_TIMEOUT_S
            )
            if not self.membership.is_alive(sender):
                self._reject("evidence_unknown_peer", sender, "no live heartbeat", update=False)
                return
            proof = Proof.from_bytes(blob, self.config.fingerprint)
            self._on_evidence(proof, sender)
        except ProofError as exc:
            self._reject(f"evidence_{exc.reason}", sender, str(exc), update=False)
        except TooLargeError as exc:
            self._reject("evidence_too_large", sender, str(exc), update=False)
        except (TransportError, OSError, TimeoutError) as exc:
            logger.debug("evidence from %s dropped: %s", sender, exc)

    # ---- repair: per-author summaries ------------------------------------------------------

    def _summary(self) -> bytes:
        """This node's applied and retained ranges (off the loop: O(applied set))."""
        applied = to_ranges(self.replica.applied)
        retained: dict[str, list[int]] = {}
        for author, seq in self.retained.ids():
            retained.setdefault(author, []).append(seq)
        return encode_request(applied=applied, retained=to_ranges(retained))

    def _ceilings(self) -> dict[str, int]:
        """Per author, the highest seq this node has evidence of (applied, in a signed header
        it checked, or announced in the author's own live heartbeat): how far a peer's
        summary may name that author's ids (+ slack). An author's heartbeat can raise only
        its own ceiling, and the caps bound what that costs."""
        ceilings = self.catchup.seen_seqs()
        for heartbeat in self.membership.alive_peers():
            author = heartbeat.peer_id
            ceilings[author] = max(ceilings.get(author, 0), heartbeat.latest_seq)
        return ceilings

    def _reduce_summary(self, blob: bytes, ceilings: dict[str, int]) -> ReducedSummary:
        """Off the loop: O(the summary's ranges + this node's applied set), never O(ids)."""
        own = to_ranges(self.replica.applied)
        return reduce_summary(blob, own, ceilings, SUMMARY_BOUNDS)

    async def _learn_summary(self, peer_id: str, blob: bytes) -> int:
        """Wants what a peer's summary names and this node lacks, within SUMMARY_BOUNDS and
        the peer's budget of ids per second; what is refused is counted against the peer."""
        ceilings = self._ceilings()
        reduced = await asyncio.to_thread(self._reduce_summary, blob, ceilings)
        applied, retained = reduced.applied, reduced.retained
        beyond, over_cap = reduced.num_beyond, reduced.num_over_cap
        if beyond:
            self._reject("summary_beyond_seq", peer_id, f"{beyond} ids past seqs", update=False)
        num_named = sum(hi - lo + 1 for runs in applied.values() for lo, hi in runs)
        granted = self._summary_budget.take(peer_id, num_named, time.monotonic())
        if granted < num_named:
            detail = f"{num_named - granted} ids over its budget per second"
            self._reject("summary_over_budget", peer_id, detail, update=False)
            applied = take_ids(applied, granted)
        learned = self.catchup.summary(peer_id, applied, retained, time.monotonic())
        if over_cap or learned.num_capped:
            detail = f"{over_cap + learned.num_capped} ids over its caps"
            self._reject("summary_over_cap", peer_id, detail, update=False)
        if learned.num_new:
            num_new = learned.num_new
            logger.info("repair: %d updates to fetch after comparing with %s", num_new, peer_id)
            self._on_event("repair", peer_id=peer_id, num_missing=num_new)
            self._kick()
        return learned.num_new

    async def _exchange_summaries(self, peer_id: str) -> None:
        try:
            answer = await self.network.exchange(
                peer_id,
                "summary",
                await asyncio.to_thread(self._summary),
                max_bytes=MAX_SUMMARY_BYTES,
                timeout_s=SUMMARY_LIMITS.deadline_s,
            )
            await self._learn_summary(peer_id, answer)
        except TooLargeError as exc:
            self._reject("summary_too_large", peer_id, str(exc), update=False)
        except (TimeoutError, TransportError, OSError) as exc:
            logger.debug("summary exchange with %s failed: %s", peer_id, exc)
        except ValueError as exc:
            self._reject("bad_summary", peer_id, str(exc))

    async def rpc_summary(self, info: Any, reader: Any, writer: Any) -> None:
        peer_id = str(info.peer_id)
        try:
            request = await receive_blob(
                reader, max_bytes=MAX_SUMMARY_BYTES, stall_timeout_s=REQUEST_READ_TIMEOUT_S
            )
            await send_blob(writer, await asyncio.to_thread(self._summary))
            if self.active and self.membership.is_alive(peer_id):  # no state for strangers
                await self._learn_summary(peer_id, request)
        except TooLargeError as exc:
            self._reject("summary_too_large", peer_id, str(exc), update=False)
        except (TransportError, OSError, TimeoutError) as exc:
            logger.debug("summary request from %s failed: %s", peer_id, exc)
        except ValueError as exc:
            self._reject("bad_summary", peer_id, str(exc))

    # ---- fetching ---------------------------------------------------------------------------

    async def _fetch_from(self, peer_id: str, author: str, seq: int) -> bytes | None:
        if peer_id == self.peer_id:
            return None
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self._transfer_timeout_s):
                data, num_attempts = await fetch_resumable(
                    lambda: self.network.open_stream(peer_id, "update"),
                    [author, seq],
                    max_bytes=self.config.max_update_bytes,
                    stall_timeout_s=REQUEST_READ_TIMEOUT_S,
                )
        except TooLargeError as exc:
            self._reject("too_large", peer_id, str(exc), seq=seq, update=peer_id == author)
            if peer_id == author:  # what its signed header names will not shrink: settled
                self.catchup.fetched((author, seq))
            return None
        except (TimeoutError, TransportError, OSError, ValueError) as exc:
            logger.debug("fetching %s/%d from %s failed: %s", author, seq, peer_id, exc)
            return None
        stats = TransferStats(len(data), time.perf_counter() - started, peer_id)
        path = await self.network.path_to(peer_id)  # the connection the fetch just used
        self.fetches.append(stats)
        self._on_event(
            "update_fetched",
            author=author,
            seq=seq,
            peer_id=peer_id,
            megabytes=round(stats.num_bytes / 1e6, 3),
            seconds=round(stats.seconds, 4),
            mb_per_s=round(stats.mb_per_s, 2),
            num_attempts=num_attempts,
            path=path,
        )
        return data

    @property
    def _transfer_timeout_s(self) -> float:
        """Enough for the largest payload over the slowest link, plus connection set-up; a
        stalled transfer is cut much sooner (no byte for REQUEST_READ_TIMEOUT_S)."""
        return 10.0 + self.config.max_update_bytes / MIN_LINK_BYTES_PER_S

    # ---- publishing and retention -----------------------------------------------------------

    async def publish(self, update: SignedUpdate) -> None:
        header = update.header
        await self._retain(update, announce_holder=False)
        blob = update.signed_header.to_bytes()
        announce = self.network.dht_store(
            f"{self.config.prefix}/updates/{header.author}",
            announcement_subkey(header.author, header.seq),
            blob,
            self.config.retention_ttl_s,
        )
        # Pushes go out beside the announcement, not after it: a DHT store waits seconds on
        # a crowded or unresponsive record (a Sybil flood), and peers that would have merged
        # the update at once then merged it a round or more stale.
        pushes = [self.network.send(p, "notify", blob, timeout_s=5.0) for p in self._push_targets()]
        results = await asyncio.gather(announce, *pushes, return_exceptions=True)
        if isinstance(results[0], BaseException):
            logger.info("announcing %s/%d failed: %s", header.author, header.seq, results[0])

    def _push_targets(self, exclude: str | None = None) -> list[str]:
        alive = [h.peer_id for h in self.membership.alive_peers() if h.peer_id != exclude]
        return push_targets(alive, lambda p: self.replica.last_seq(p) >= 1)

    async def _retain(self, update: SignedUpdate, *, announce_holder: bool = True) -> None:
        author, seq = update.header.update_id
        # Off the loop: beyond the memory budget this writes to disk.
        await asyncio.to_thread(self.retained.put, (author, seq), update.to_bytes())
        if announce_holder and not self.config.client_mode:
            # In the background: a DHT store can wait seconds on an unresponsive member,
            # and the next update must not wait for it.
            key = f"{self.config.prefix}/holders/{author}"
            ttl = self.config.retention_ttl_s
            subkey = holder_subkey(self.peer_id, seq)
            self.network.spawn(self.network.dht_store(key, subkey, True, ttl))

    async def announced_seq(self, author: str) -> int:
        """The highest seq `author` announced that the DHT still holds (0 if none)."""
        announced = await self.network.dht_get(f"{self.config.prefix}/updates/{author}")
        seqs = [0]
        for subkey in announced:
            with contextlib.suppress(MessageError):
                seqs.append(parse_announced_seq(subkey, author))
        return max(seqs)

    # ---- serving ----------------------------------------------------------------------------

    async def rpc_update(self, _info: Any, reader: Any, writer: Any) -> None:
        """Serve a retained update from the offset asked (dht.resumable; the stream's deadline
        and closing: SwarmNetwork)."""
        try:
            request = await asyncio.wait_for(
                receive_blob(reader, max_bytes=4096), REQUEST_READ_TIMEOUT_S
            )
            args = decode_request(request).get("args")
            whole = isinstance(args, list) and len(args) == 2  # a node of an earlier version
            uid, offset = (parse_update_request(args), 0) if whole else parse_part_request(args)
            data = await asyncio.to_thread(self.retained.get, uid)
            if data is None:
                await send_refusal(writer, "not held")
            else:
                await send_blob(writer, data if whole else part_answer(data, offset))
        except (TransportError, ValueError, TypeError, OSError, TimeoutError) as exc:
            logger.debug("update request failed: %s", exc)

    async def rpc_notify(self, info: Any, reader: Any, writer: Any) -> None:
        """A pushed header: verified before anything about its author is stored or marked.

        Only peers with a live signed heartbeat may push, within a per-peer budget
        (NOTIFY_LIMITS, enforced by SwarmNetwork), and only headers of authors with a live
        heartbeat are kept: fresh keys get no state here.
        """
        sender = str(info.peer_id)
        try:
            blob = await asyncio.wait_for(
                receive_blob(reader, max_bytes=MAX_SIGNED_HEADER_BYTES), REQUEST_READ_TIMEOUT_S
            )
            signed = parse_signed_header(blob)
            author = signed.header.author
            if author == self.peer_id or not self.active:
                return
            if not (self.membership.is_alive(sender) and self.membership.is_alive(author)):
                # Held until the next reads (dht.deferred): a peer that just joined pushes
                # before this node has read its heartbeat.
                known = self.replica.last_seq(sender) >= 1  # a track record: held first
                for evicted in self._deferred.hold(sender, signed, time.time(), known=known):
                    self._reject_unknown(evicted)
                return
            self._on_header(signed)
        except MessageError as exc:  # counted against who sent it, not whom it names
            self._reject(f"notify_{exc.reason}", sender, str(exc), update=False)
        except TooLargeError as exc:
            self._reject("notify_too_large", sender, str(exc), update=False)
        except TimeoutError:
            self._reject("notify_timeout", sender, "no header within the timeout", update=False)
        except (TransportError, OSError) as exc:
            logger.debug("notification from %s dropped: %s", sender, exc)


def parse_update_request(args: object) -> tuple[str, int]:
    """The (author, seq) a peer asks for: a short author string and a seq in [1, MAX_SEQ]."""
    if not isinstance(args, list) or len(args) != 2:
        raise TransportError("malformed request")
    author, seq = args
    if not isinstance(author, str) or not 0 < len(author) <= 128:
        raise TransportError("malformed request: the author is not a short string")
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        raise TransportError("malformed request: the seq is not an integer in range")
    return author, seq


def push_targets(
    alive: list[str], contributed: Callable[[str], bool], newcomers: int = MAX_PUSH_NEWCOMERS
) -> list[str]:
    """The live peers a header or proof is pushed to, in `alive`'s order: every peer that has
    contributed, and at most `newcomers` that have not (a newcomer finds the rest through
    announcements). ~1,000 Sybil heartbeats cost a few streams a publish, not a thousand
    (open files rose to ~900 of 1,024 in bench.attack's Sybil class)."""
    contributors = [p for p in alive if contributed(p)]
    others = [p for p in alive if not contributed(p)]
    return contributors + others[:newcomers]
