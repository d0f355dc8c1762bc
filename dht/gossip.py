"""Gossip: announce this node's updates, fetch and merge peers' updates, serve retained ones."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from dht.heartbeat import Heartbeat
from dht.membership import Membership
from dht.network import Rejections, SwarmNetwork
from dht.state_transfer import TransferStats
from dht.transport import TransportError, decode_request, receive_blob, send_blob, send_refusal
from merge.envelope import EnvelopeError, SignedHeader, SignedUpdate
from merge.pipeline import MergeResult, UpdatePipeline

logger = logging.getLogger(__name__)
GAP_PATIENCE_S = 30.0
"""How long a later update of an author waits for a missing earlier one before skipping it."""
MAX_PUSHED_PER_AUTHOR = 256
"""Pushed headers buffered per author before they are merged; more are dropped (DHT has them)."""


class Gossip:
    """Moves signed updates between peers: push notifications, DHT announcements, fetches."""

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
        self._merge_pool = merge_pool
        self._reject = reject
        self._on_merge = on_merge
        self._on_event = on_event
        self._retained: OrderedDict[tuple[str, int], SignedUpdate] = OrderedDict()
        self._pushed: dict[str, dict[int, bytes]] = {}
        self._processed: dict[str, int] = {}
        self._author_tasks: dict[str, asyncio.Task[None]] = {}
        self._gaps: dict[tuple[str, int], float] = {}

    async def register(self) -> None:
        await self.network.add_handler("update", self.rpc_update)
        await self.network.add_handler("notify", self.rpc_notify)

    def on_heartbeats(self, heartbeats: list[Heartbeat]) -> None:
        """Start catching up with every author announcing more than this node has."""
        if not self.active:
            return
        for heartbeat in heartbeats:
            if heartbeat.latest_seq > self._floor(heartbeat.peer_id):
                self._ensure_author_task(heartbeat.peer_id)

    # ---- catch-up ---------------------------------------------------------------------------

    def _ensure_author_task(self, author: str) -> None:
        task = self._author_tasks.get(author)
        if task is None or task.done():
            self._author_tasks[author] = asyncio.create_task(self._catch_up(author))

    async def _catch_up(self, author: str) -> None:
        """Fetch and merge `author`'s announced updates in seq order (replays are rejected).

        Headers pushed by the author are used as they are; the DHT is asked only when the
        next seq is missing, so a slow or frozen DHT member does not slow merging.
        """
        floor = self._floor(author)
        announced: dict[Any, Any] = self._pushed.pop(author, {})
        if floor + 1 not in announced:
            announced |= await self.network.dht_get(f"{self.config.prefix}/updates/{author}")
        for seq in sorted(s for s in announced if isinstance(s, int) and s > floor):
            if seq > floor + 1 and not self._give_up_gap(author, floor + 1, seq):
                self._pushed.setdefault(author, {}).update(announced)
                return  # an earlier seq is still on its way: merge in order
            signed = self._parse_announcement(author, seq, announced[seq])
            if signed is not None and not await self._fetch_and_merge(signed):
                return  # payload unavailable for now: retry on a later poll
            self._processed[author] = floor = seq
        if self._pushed.get(author):
            self._author_tasks[author] = asyncio.create_task(self._catch_up(author))

    def _floor(self, author: str) -> int:
        """The last seq of `author` this node has merged or given up on (seqs start at 1)."""
        return max(0, self._processed.get(author, 0), self.replica.last_seq(author))

    def _give_up_gap(self, author: str, missing: int, next_seq: int) -> bool:
        """Wait a while for a missing seq before skipping it (its author may have died)."""
        if not self._out_of_patience(author, missing):
            return False
        for seq in range(missing, next_seq):
            self._reject("unavailable", author, "never announced", seq=seq)
        return True

    def _out_of_patience(self, author: str, seq: int) -> bool:
        first_seen = self._gaps.setdefault((author, seq), time.monotonic())
        if time.monotonic() - first_seen < GAP_PATIENCE_S:
            return False
        del self._gaps[(author, seq)]
        return True

    def _parse_announcement(self, author: str, seq: int, blob: object) -> SignedHeader | None:
        try:
            if not isinstance(blob, bytes):
                raise EnvelopeError("malformed", "announcement is not bytes")
            signed = SignedHeader.from_bytes(blob)
        except EnvelopeError as exc:
            self._reject(exc.reason, author, str(exc), seq=seq)
            return None
        if signed.header.author != author or signed.header.seq != seq:
            self._reject("malformed", author, "announcement key disagrees with header", seq=seq)
            return None
        reason = self.pipeline.check_header(signed)
        if reason is not None:
            if reason not in ("duplicate", "replay"):
                self._reject(reason, author, "header check failed", seq=seq)
            return None
        return signed

    async def _fetch_and_merge(self, signed: SignedHeader) -> bool:
        """False when the payload could not be had yet and is worth retrying later."""
        header = signed.header
        data = await self._fetch_update(header.author, header.seq)
        if data is None:
            author_alive = self.membership.is_alive(header.author)
            if author_alive and not self._out_of_patience(header.author, header.seq):
                return False
            self._reject("unavailable", header.author, "no live peer holds it", seq=header.seq)
            return True
        try:
            update = SignedUpdate.from_bytes(data)
        except EnvelopeError as exc:
            self._reject(exc.reason, header.author, str(exc), seq=header.seq)
            return True
        if update.signed_header != signed:
            self._reject("malformed", header.author, "payload header differs", seq=header.seq)
            return True
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._merge_pool, self.pipeline.submit, update)
        self._on_merge(result)
        if result.accepted:
            self._retain(update)
        return True

    # ---- fetching ---------------------------------------------------------------------------

    async def _fetch_update(self, author: str, seq: int) -> bytes | None:
        """The update's bytes from its author or, failing that, from any peer holding it."""
        data = await self._fetch_from(author, author, seq)
        if data is not None:
            return data
        holders = await self.network.dht_get(f"{self.config.prefix}/holders/{author}")
        for subkey in holders:
            if isinstance(subkey, str) and subkey.startswith(f"{seq}:"):
                data = await self._fetch_from(subkey.split(":", 1)[1], author, seq)
                if data is not None:
                    return data
        return None

    async def _fetch_from(self, peer_id: str, author: str, seq: int) -> bytes | None:
        if peer_id == self.peer_id:
            return None
        started = time.perf_counter()
        try:
            data = await asyncio.wait_for(
                self.network.request(peer_id, "update", self.config.max_update_bytes, author, seq),
                timeout=self._transfer_timeout_s,
            )
        except (TimeoutError, TransportError, OSError, ValueError) as exc:
            logger.debug("fetching %s/%d from %s failed: %s", author, seq, peer_id, exc)
            return None
        stats = TransferStats(len(data), time.perf_counter() - started, peer_id)
        self.fetches.append(stats)
        self._on_event(
            "update_fetched",
            author=author,
            seq=seq,
            peer_id=peer_id,
            megabytes=round(stats.num_bytes / 1e6, 3),
            seconds=round(stats.seconds, 4),
            mb_per_s=round(stats.mb_per_s, 2),
        )
        return data

    @property
    def _transfer_timeout_s(self) -> float:
        """Enough for the largest payload at 2 MB/s, plus connection set-up."""
        return 10.0 + self.config.max_update_bytes / 2e6

    # ---- publishing and retention -----------------------------------------------------------

    async def publish(self, update: SignedUpdate) -> None:
        header = update.header
        self._retain(update, announce_holder=False)
        blob = update.signed_header.to_bytes()
        await self.network.dht_store(
            f"{self.config.prefix}/updates/{header.author}",
            header.seq,
            blob,
            self.config.retention_ttl_s,
        )
        peers = self.membership.alive_peers()
        await asyncio.gather(
            *(asyncio.wait_for(self.network.send(h.peer_id, "notify", blob), 5.0) for h in peers),
            return_exceptions=True,
        )

    def _retain(self, update: SignedUpdate, *, announce_holder: bool = True) -> None:
        author, seq = update.header.update_id
        self._retained[(author, seq)] = update
        per_author = [key for key in self._retained if key[0] == author]
        for old in per_author[: -self.config.retain_updates]:
            del self._retained[old]
        if announce_holder and not self.config.client_mode:
            # In the background: a DHT store can wait seconds on an unresponsive member,
            # and the next update must not wait for it.
            key = f"{self.config.prefix}/holders/{author}"
            ttl = self.config.retention_ttl_s
            self.network.spawn(self.network.dht_store(key, f"{seq}:{self.peer_id}", True, ttl))

    async def announced_seq(self, author: str) -> int:
        announced = await self.network.dht_get(f"{self.config.prefix}/updates/{author}")
        return max((s for s in announced if isinstance(s, int)), default=0)

    # ---- serving ----------------------------------------------------------------------------

    async def rpc_update(self, _info: Any, reader: Any, writer: Any) -> None:
        try:
            args = decode_request(await receive_blob(reader, max_bytes=4096)).get("args")
            if not isinstance(args, list) or len(args) != 2:
                raise TransportError("malformed request")
            update = self._retained.get((str(args[0]), int(args[1])))
            if update is None:
                await send_refusal(writer, "not held")
            else:
                await send_blob(writer, update.to_bytes())
        except (TransportError, ValueError, TypeError, OSError) as exc:
            logger.debug("update request failed: %s", exc)
        finally:
            writer.close()

    async def rpc_notify(self, info: Any, reader: Any, writer: Any) -> None:
        try:
            signed = SignedHeader.from_bytes(await receive_blob(reader, max_bytes=8192))
            author = signed.header.author
            pending = self._pushed.setdefault(author, {}) if self.active else {}
            if author != self.peer_id and self.active and len(pending) < MAX_PUSHED_PER_AUTHOR:
                pending[signed.header.seq] = signed.to_bytes()
                self._ensure_author_task(author)
        except (TransportError, EnvelopeError, OSError) as exc:
            logger.debug("notification from %s dropped: %s", info.peer_id, exc)
        finally:
            writer.close()
