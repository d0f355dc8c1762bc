"""Announcements: this node's updates announced (signed headers in the DHT, pushed to peers,
holder records for what it retains), and peers' announcements and holder records looked up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from dht.gossip_context import GossipContext
from dht.heartbeat import Heartbeat
from dht.membership import SeenSet
from dht.messages import (
    MessageError,
    announcement_subkey,
    holder_ranges,
    holder_subkey,
    parse_announced_seq,
    parse_holder,
    parse_signed_header,
)
from dht.records import subkey_owner
from merge.envelope import SignedHeader, SignedUpdate

logger = logging.getLogger(__name__)
MAX_LOOKUPS = 64
"""DHT lookups (announcements, holders) running at once."""
MAX_LOOKUPS_PER_POLL = 8
"""Announcement lookups started per membership poll."""
MAX_ANNOUNCEMENTS_PER_LOOKUP = 64
"""Announced headers of one author whose signatures one lookup checks (lowest unknown seqs)."""
HOLDER_WRITE_PERIOD_S = 1.0
"""Least time between two writes of this node's holder record of one author: an author
publishing fast (a flood) costs one DHT store a second, not one per update."""


class Announcements:
    """Publishes this node's updates and retained copies; looks up the announcements of
    authors ahead of this node and who holds what CatchUp wants (one lookup per key at once).
    Each header read is handed to `on_header`."""

    def __init__(self, context: GossipContext, on_header: Callable[[SignedHeader], None]) -> None:
        self._ctx = context
        self._on_header = on_header
        self._lookups: dict[str, asyncio.Task[None]] = {}
        self._looked_up: dict[str, int] = {}
        """Per author, the highest announced seq a lookup was started for."""
        self._bad_records = SeenSet(4096)
        self._holder_writes: dict[str, bool] = {}
        """Authors whose holder record is being written: True when it must be written again."""

    # ---- this node's updates ----------------------------------------------------------------

    async def publish(self, update: SignedUpdate) -> None:
        ctx, header = self._ctx, update.header
        await self.retain(update, announce_holder=False)
        blob = update.signed_header.to_bytes()
        announce = ctx.network.dht_store(
            f"{ctx.config.prefix}/updates/{header.author}",
            announcement_subkey(header.author, header.seq),
            blob,
            ctx.config.retention_ttl_s,
        )
        # Pushes go out beside the announcement, not after it: a DHT store waits seconds on
        # a crowded or unresponsive record (a Sybil flood), and peers that would have merged
        # the update at once then merged it a round or more stale.
        pushes = [ctx.network.send(p, "notify", blob, timeout_s=5.0) for p in ctx.push_targets()]
        results = await asyncio.gather(announce, *pushes, return_exceptions=True)
        if isinstance(results[0], BaseException):
            logger.info("announcing %s/%d failed: %s", header.author, header.seq, results[0])

    async def retain(self, update: SignedUpdate, *, announce_holder: bool = True) -> None:
        await self.retain_blob(update.header.update_id, update.to_bytes(), announce_holder)

    async def retain_blob(
        self, uid: tuple[str, int], blob: bytes, announce_holder: bool = True
    ) -> None:
        """Keep `blob` (an update's wire bytes: a peer's signed update or a learner group's,
        dht.gossip_groups) to serve under `uid`, and say so in this node's holder record."""
        ctx = self._ctx
        # Off the loop: beyond the memory budget this writes to disk.
        await asyncio.to_thread(ctx.retained.put, uid, blob)
        if announce_holder and not ctx.config.client_mode:
            self._announce_holder(uid[0])

    def _announce_holder(self, author: str) -> None:
        """Rewrite this node's one subkey of `author`'s holder record (dht.messages.HolderRecord)
        in the background: a DHT store can wait seconds on an unresponsive member, and the next
        update must not wait for it. One write per author at a time, at most one every
        HOLDER_WRITE_PERIOD_S; what was retained meanwhile goes into the next one."""
        if author in self._holder_writes:
            self._holder_writes[author] = True
            return
        self._holder_writes[author] = False
        self._ctx.network.spawn(self._write_holder(author))

    async def _write_holder(self, author: str) -> None:
        ctx = self._ctx
        key = f"{ctx.config.prefix}/holders/{author}"
        try:
            while True:
                self._holder_writes[author] = False
                started = time.monotonic()
                seqs = ctx.retained.seqs(author)
                if seqs:
                    value = holder_ranges(seqs)
                    await ctx.network.dht_store(
                        key, holder_subkey(ctx.peer_id), value, ctx.config.retention_ttl_s
                    )
                if not self._holder_writes.get(author):
                    return
                await asyncio.sleep(HOLDER_WRITE_PERIOD_S - (time.monotonic() - started))
        except Exception as exc:  # a failed store costs this record, never the node
            logger.info("storing the holder record of %s failed: %s", author, exc)
        finally:
            self._holder_writes.pop(author, None)

    async def announced_seq(self, author: str) -> int:
        """The highest seq `author` announced that the DHT still holds (0 if none)."""
        announced = await self._ctx.network.dht_get(f"{self._ctx.config.prefix}/updates/{author}")
        seqs = [0]
        for subkey in announced:
            with contextlib.suppress(MessageError):
                seqs.append(parse_announced_seq(subkey, author))
        return max(seqs)

    # ---- peers' announcements ---------------------------------------------------------------

    def look_up_ahead(self, heartbeats: list[Heartbeat]) -> None:
        """Look up the announcements of authors whose heartbeat is ahead of what this node
        knows. Contributors first: a flood of fresh keys claiming seqs waits behind them, and
        costs at most MAX_LOOKUPS_PER_POLL DHT reads a poll (the rest are looked up later)."""
        ctx, started = self._ctx, 0
        for heartbeat in sorted(heartbeats, key=lambda h: ctx.replica.last_seq(h.peer_id) < 1):
            author = heartbeat.peer_id
            known = max(ctx.catchup.max_seen(author), ctx.replica.last_seq(author))
            if heartbeat.latest_seq > max(known, self._looked_up.get(author, 0)):
                if started >= MAX_LOOKUPS_PER_POLL or self._lookups_in_flight() >= MAX_LOOKUPS:
                    break
                self._looked_up[author] = heartbeat.latest_seq
                self._lookup(author, self._lookup_announcements(author))
                started += 1

    def look_up_holders(self, author: str) -> None:
        self._lookup(f"holders/{author}", self._lookup_holders(author))

    def forget_peer(self, peer_id: str) -> None:
        """`peer_id` left: drop its finished lookups and what was looked up for it."""
        self._looked_up.pop(peer_id, None)
        for key in (peer_id, f"holders/{peer_id}"):
            task = self._lookups.get(key)
            if task is not None and task.done():
                del self._lookups[key]

    def _lookup(self, key: str, coro: Coroutine[Any, Any, None]) -> None:
        """One DHT lookup per key at a time; finished ones are dropped (the map stays small)."""
        task = self._lookups.get(key)
        if task is not None and not task.done():
            coro.close()
            return
        if len(self._lookups) >= MAX_LOOKUPS:
            self._lookups = {k: t for k, t in self._lookups.items() if not t.done()}
        self._lookups[key] = self._ctx.network.spawn(coro)

    def _lookups_in_flight(self) -> int:
        return sum(not task.done() for task in self._lookups.values())

    async def _lookup_announcements(self, author: str) -> None:
        """The author's announced headers this node does not know yet, the lowest
        MAX_ANNOUNCEMENTS_PER_LOOKUP seqs first: an author storing a hundred thousand subkeys
        costs a bounded number of signature checks per lookup (the rest come in later ones)."""
        ctx = self._ctx
        announced = await ctx.network.dht_get(f"{ctx.config.prefix}/updates/{author}")
        unknown = []
        for subkey, blob in announced.items():
            seq = self._announced_seq(author, subkey, blob)
            if seq is not None and not ctx.catchup.knows((author, seq)):
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
        ctx = self._ctx
        holders = await ctx.network.dht_get(f"{ctx.config.prefix}/holders/{author}")
        now = time.monotonic()
        for subkey, value in holders.items():
            try:
                record = parse_holder(subkey, value)
            except MessageError as exc:
                self._reject_record(f"holder_{exc.reason}", subkey, value, str(exc))
                continue
            ctx.catchup.held(author, record.holder, record.ranges, now)
        ctx.kick()

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
            self._ctx.reject(reason, writer, detail, seq=seq, update=seq is not None)
