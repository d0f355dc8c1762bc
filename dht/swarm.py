"""The swarm: discovery, heartbeats, gossip of signed pseudo-gradients, state download.

Everything here runs on one asyncio loop in a background thread, so the learner never waits
on the network. hivemind's DHT (a forked process) holds small signed records: heartbeats,
update announcements (signed headers) and holder lists. Payloads and replica state travel
over libp2p streams of the node's own p2pd, never through DHT.store.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import json
import logging
import signal
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from hivemind import DHT
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils import get_dht_time

from dht.heartbeat import Heartbeat, HeartbeatError
from dht.reaper import OrphanReaper
from dht.transport import (
    TransportError,
    decode_request,
    encode_request,
    receive_blob,
    send_blob,
    send_refusal,
)
from merge.envelope import EnvelopeError, SignedHeader, SignedUpdate
from merge.identity import Identity
from merge.pipeline import MergeResult, UpdatePipeline
from merge.replica import Replica

logger = logging.getLogger(__name__)
T = TypeVar("T")
GAP_PATIENCE_S = 30.0
MAX_PUSHED_PER_AUTHOR = 256
"""Pushed headers buffered per author before they are merged; more are dropped (DHT has them)."""
"""How long a later update of an author waits for a missing earlier one before skipping it."""


class SwarmError(ValueError):
    """The swarm could not be joined; the message says why in one sentence."""


class RunMismatchError(SwarmError):
    """The swarm trains the same run id with another model or merge configuration."""


@dataclass(frozen=True, kw_only=True)
class SwarmConfig:
    run_id: str
    fingerprint: str
    run_summary: dict[str, Any]
    """Model and merge settings, shown to a node whose configuration differs."""
    identity_path: str
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/127.0.0.1/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    use_relay: bool = True
    use_auto_relay: bool = False
    client_mode: bool = False
    serve_state: bool = True
    heartbeat_period_s: float = 5.0
    retain_updates: int = 16
    max_update_bytes: int = 1 << 30
    max_state_bytes: int = 4 << 30

    @property
    def prefix(self) -> str:
        return f"diloco/{self.fingerprint[:16]}"


@dataclass
class PeerView:
    heartbeat: Heartbeat
    last_seen: float
    first_seen: float
    gone: bool = False

    def alive(self, period_s: float) -> bool:
        return time.time() - self.last_seen < 3 * period_s


@dataclass(frozen=True)
class TransferStats:
    num_bytes: int
    seconds: float
    peer_id: str

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / 1e6 / max(self.seconds, 1e-9)


class Swarm:
    """This node's membership in the swarm; thread-safe entry points, async internals."""

    def __init__(
        self,
        config: SwarmConfig,
        identity: Identity,
        replica: Replica,
        pipeline: UpdatePipeline,
        *,
        heartbeat_fn: Callable[[], Heartbeat],
        on_merge: Callable[[MergeResult], None],
        on_event: Callable[..., None],
    ) -> None:
        self.config = config
        self.identity = identity
        self.peer_id = identity.peer_id
        self.replica = replica
        self.pipeline = pipeline
        self._heartbeat_fn = heartbeat_fn
        self._on_merge = on_merge
        self._on_event = on_event
        self.peers: dict[str, PeerView] = {}
        self.rejections: Counter[str] = Counter()
        self.fetches: deque[TransferStats] = deque(maxlen=1000)
        self.visible_maddrs: list[str] = []
        self._retained: OrderedDict[tuple[str, int], SignedUpdate] = OrderedDict()
        self._pushed: dict[str, dict[int, bytes]] = {}
        self._processed: dict[str, int] = {}
        self._author_tasks: dict[str, asyncio.Task[None]] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="swarm", daemon=True)
        self._merge_pool = ThreadPoolExecutor(1, thread_name_prefix="merge")
        self._tasks: list[asyncio.Task[None]] = []
        self._reaper = OrphanReaper()
        self._p2p: P2P | None = None
        self._dht: DHT | None = None
        self._gossip = False
        self._gaps: dict[tuple[str, int], float] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._bad_heartbeats = _SeenSet(4096)
        self._publishing: set[concurrent.futures.Future[None]] = set()

    # ---- thread-safe entry points --------------------------------------------------------

    def start(self, timeout_s: float = 60.0) -> list[str]:
        """Start p2pd and the DHT, refuse a mismatched run, begin heartbeats.

        Gossip starts with start_gossip(), after an optional download_state().
        """
        self._reaper.start()
        self._thread.start()
        try:
            self._p2p = self._call(self._create_p2p(), timeout_s)
        except P2PDaemonError as exc:
            reason = str(exc).splitlines()[-1] if str(exc) else type(exc).__name__
            peers = ", ".join(self.config.initial_peers) or "none"
            raise SwarmError(f"could not start the p2p daemon (peers: {peers}): {reason}") from None
        assert self._p2p._child is not None
        self._reaper.watch(self._p2p._child.pid)
        # The DHT forks; do it from this (main) thread rather than the loop's, and without
        # the node's SIGTERM handler, which would make the DHT child ignore SIGTERM.
        previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
        try:
            self._dht = DHT(
                initial_peers=self.config.initial_peers or None,
                p2p=self._p2p,
                start=True,
                client_mode=self.config.client_mode,
                shutdown_timeout=3,
                wait_timeout=self._dht_wait_timeout_s,  # per request to one DHT member
            )
        finally:
            signal.signal(signal.SIGTERM, previous)
        assert self._dht.pid is not None
        self._reaper.watch(self._dht.pid)
        self._call(self._register_handlers(), timeout_s)
        self.visible_maddrs = [str(m) for m in self._dht.get_visible_maddrs(latest=True)]
        self._call(self._check_run(), timeout_s)
        self._call(self._start_heartbeats(), timeout_s)
        return self.visible_maddrs

    def start_gossip(self, timeout_s: float = 60.0) -> None:
        """Begin heartbeats and fetching and merging peers' updates in the background."""
        self._call(self._start_loops(), timeout_s)

    def download_state(self, timeout_s: float = 300.0) -> TransferStats | None:
        """Replace the replica with the most advanced live peer's, if any peer is ahead."""
        return self._call(self._download_state(), timeout_s)

    def announced_seq(self) -> int:
        """The highest seq this identity has announced and the swarm still remembers."""
        return self._call(self._announced_seq(self.peer_id), 30.0)

    def publish(self, update: SignedUpdate) -> None:
        """Announce an update this node authored and merged; never blocks the caller."""
        future = asyncio.run_coroutine_threadsafe(self._publish(update), self._loop)
        # asyncio holds tasks weakly: without this reference a publish waiting on the DHT
        # can be garbage-collected half-way.
        self._publishing.add(future)
        future.add_done_callback(self._publishing.discard)

    def alive_peers(self) -> list[Heartbeat]:
        period = self.config.heartbeat_period_s
        return [v.heartbeat for v in list(self.peers.values()) if v.alive(period)]

    def shutdown(self) -> None:
        if self._thread.is_alive():
            try:
                self._call(self._stop_loops(), 10.0)
            except Exception as exc:  # shutting down: report, keep going
                logger.warning("stopping swarm tasks failed: %s", exc)
        if self._dht is not None:
            self._dht.shutdown()
        if self._p2p is not None and self._thread.is_alive():
            try:
                self._call(self._p2p.shutdown(), 10.0)
            except Exception as exc:
                logger.warning("stopping p2pd failed: %s", exc)
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        self._merge_pool.shutdown(wait=True, cancel_futures=True)
        self._reaper.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # ---- start-up ---------------------------------------------------------------------------

    async def _create_p2p(self) -> P2P:
        return await P2P.create(
            initial_peers=self.config.initial_peers or None,
            host_maddrs=self.config.host_maddrs,
            announce_maddrs=self.config.announce_maddrs or None,
            identity_path=self.config.identity_path,
            use_relay=self.config.use_relay,
            use_auto_relay=self.config.use_auto_relay,
            dht_mode="client" if self.config.client_mode else "server",
            check_if_identity_free=False,  # hivemind's check assumes RSA keys
            startup_timeout=30,
        )

    def _protocol(self, name: str) -> str:
        return f"/diloco/{self.config.fingerprint[:16]}/{name}/1"

    async def _register_handlers(self) -> None:
        assert self._p2p is not None
        await self._p2p.add_binary_stream_handler(self._protocol("update"), self._serve_update)
        await self._p2p.add_binary_stream_handler(self._protocol("state"), self._serve_state)
        await self._p2p.add_binary_stream_handler(self._protocol("notify"), self._serve_notify)

    async def _check_run(self) -> None:
        """A node whose run id is trained with another configuration is told so, clearly."""
        records = await self._dht_get(f"diloco-run/{self.config.run_id}")
        others = {fp: summary for fp, summary in records.items() if fp != self.config.fingerprint}
        if others and self.config.fingerprint not in records:
            fingerprint, summary = next(iter(others.items()))
            raise RunMismatchError(
                f"run '{self.config.run_id}' in this swarm uses a different model or run "
                f"configuration (fingerprint {str(fingerprint)[:12]}: {summary}) than this node "
                f"(fingerprint {self.config.fingerprint[:12]}: {self.config.run_summary}); "
                "join with the same settings or choose another --run-id"
            )

    async def _start_heartbeats(self) -> None:
        await self._send_heartbeat()
        period = self.config.heartbeat_period_s
        self._tasks.append(asyncio.create_task(self._every(period, self._send_heartbeat)))

    async def _start_loops(self) -> None:
        self._gossip = True
        await self._poll()
        self._tasks.append(asyncio.create_task(self._every(self._poll_period_s, self._poll)))

    @property
    def _poll_period_s(self) -> float:
        return min(1.0, self.config.heartbeat_period_s / 2)

    async def _stop_loops(self) -> None:
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

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
                logger.warning("%s failed: %s", action.__name__, exc)

    # ---- DHT records ------------------------------------------------------------------------

    @property
    def _dht_wait_timeout_s(self) -> float:
        return max(1.0, min(3.0, self.config.heartbeat_period_s))

    async def _dht_get(self, key: str) -> dict[Any, Any]:
        """Subkey -> value of a dictionary record; {} when absent, malformed or too slow.

        Bounded: a frozen DHT member must not stall the poll loop (peers would look dead).
        """
        assert self._dht is not None
        try:
            found = await asyncio.wait_for(
                self._dht.get(key, latest=True, return_future=True),
                timeout=2 * self._dht_wait_timeout_s + 1,
            )
        except TimeoutError:
            logger.debug("DHT get %s timed out", key)
            return {}
        if found is None or not isinstance(found.value, dict):
            return {}
        return {subkey: item.value for subkey, item in found.value.items()}

    async def _dht_store(self, key: str, subkey: str | int, value: Any, ttl_s: float) -> None:
        assert self._dht is not None
        await self._dht.store(key, value, get_dht_time() + ttl_s, subkey=subkey, return_future=True)

    async def _send_heartbeat(self) -> None:
        heartbeat = self._heartbeat_fn()
        ttl = 3 * self.config.heartbeat_period_s
        await self._dht_store(
            f"{self.config.prefix}/peers", self.peer_id, heartbeat.sign(self.identity), ttl
        )
        await self._dht_store(
            f"diloco-run/{self.config.run_id}",
            self.config.fingerprint,
            json.dumps(self.config.run_summary, sort_keys=True),
            ttl,
        )

    # ---- gossip -----------------------------------------------------------------------------

    async def _poll(self) -> None:
        records = await self._dht_get(f"{self.config.prefix}/peers")
        now = time.time()
        for peer_id, blob in records.items():
            if peer_id == self.peer_id or not isinstance(peer_id, str):
                continue
            try:
                heartbeat = Heartbeat.verify(blob, peer_id)
            except HeartbeatError as exc:
                if self._bad_heartbeats.add(hash(blob) if isinstance(blob, bytes) else 0):
                    self._reject("bad_heartbeat", peer_id, str(exc))
                continue
            self._see_peer(heartbeat, now)
            if self._gossip and heartbeat.latest_seq > self._floor(peer_id):
                self._ensure_author_task(peer_id)
        self._forget_dead_peers()

    def _see_peer(self, heartbeat: Heartbeat, now: float) -> None:
        view = self.peers.get(heartbeat.peer_id)
        if view is None or not view.alive(self.config.heartbeat_period_s):
            self._on_event("peer_joined", peer_id=heartbeat.peer_id, org=heartbeat.org)
            self.peers[heartbeat.peer_id] = PeerView(heartbeat, now, now)
        elif heartbeat.sent_at >= view.heartbeat.sent_at:
            view.heartbeat, view.last_seen = heartbeat, now

    def _forget_dead_peers(self) -> None:
        for peer_id, view in list(self.peers.items()):
            if not view.alive(self.config.heartbeat_period_s) and not view.gone:
                view.gone = True
                self._on_event("peer_left", peer_id=peer_id, last_seen=round(view.last_seen, 3))

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
            announced |= await self._dht_get(f"{self.config.prefix}/updates/{author}")
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
            author_alive = header.author in {h.peer_id for h in self.alive_peers()}
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
            await self._retain(update)
        return True

    async def _fetch_update(self, author: str, seq: int) -> bytes | None:
        """The update's bytes from its author or, failing that, from any peer holding it."""
        data = await self._fetch_from(author, author, seq)
        if data is not None:
            return data
        holders = await self._dht_get(f"{self.config.prefix}/holders/{author}")
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
                self._request(peer_id, "update", self.config.max_update_bytes, author, seq),
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

    async def _request(self, peer_id: str, name: str, max_bytes: int, *args: Any) -> bytes:
        assert self._p2p is not None
        _, reader, writer = await self._p2p.call_binary_stream_handler(
            PeerID.from_base58(peer_id), self._protocol(name)
        )
        try:
            await send_blob(writer, encode_request(args=list(args)))
            return await receive_blob(reader, max_bytes=max_bytes)
        finally:
            writer.close()

    async def _publish(self, update: SignedUpdate) -> None:
        header = update.header
        await self._retain(update, announce_holder=False)
        blob = update.signed_header.to_bytes()
        ttl = self._retention_ttl_s
        await self._dht_store(
            f"{self.config.prefix}/updates/{header.author}", header.seq, blob, ttl
        )
        await asyncio.gather(
            *(asyncio.wait_for(self._notify(h.peer_id, blob), 5.0) for h in self.alive_peers()),
            return_exceptions=True,
        )

    @property
    def _retention_ttl_s(self) -> float:
        """Announcements outlive a few heartbeat periods but stay small: every subkey of an
        author's record travels through hivemind's DHT pipe on each get (HIVEMIND.md item 1)."""
        return max(60.0, 12 * self.config.heartbeat_period_s)

    async def _notify(self, peer_id: str, blob: bytes) -> None:
        assert self._p2p is not None
        _, _, writer = await self._p2p.call_binary_stream_handler(
            PeerID.from_base58(peer_id), self._protocol("notify")
        )
        try:
            await send_blob(writer, blob)
        finally:
            writer.close()

    async def _retain(self, update: SignedUpdate, *, announce_holder: bool = True) -> None:
        author, seq = update.header.update_id
        self._retained[(author, seq)] = update
        per_author = [key for key in self._retained if key[0] == author]
        for old in per_author[: -self.config.retain_updates]:
            del self._retained[old]
        if announce_holder and not self.config.client_mode:
            # In the background: a DHT store can wait seconds on an unresponsive member,
            # and the next update must not wait for it.
            key = f"{self.config.prefix}/holders/{author}"
            self._spawn(self._dht_store(key, f"{seq}:{self.peer_id}", True, self._retention_ttl_s))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)  # asyncio holds tasks weakly
        task.add_done_callback(self._background.discard)

    async def _announced_seq(self, author: str) -> int:
        announced = await self._dht_get(f"{self.config.prefix}/updates/{author}")
        return max((s for s in announced if isinstance(s, int)), default=0)

    def _reject(self, reason: str, author: str, detail: str, *, seq: int | None = None) -> None:
        self.rejections[reason] += 1
        logger.info("rejected %s from %s (seq %s): %s", reason, author, seq, detail)
        if reason != "bad_heartbeat":
            self._on_merge(MergeResult(False, author, seq or -1, 0, 0.0, reason))

    # ---- serving ----------------------------------------------------------------------------

    async def _serve_update(self, _info: Any, reader: Any, writer: Any) -> None:
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

    async def _serve_notify(self, info: Any, reader: Any, writer: Any) -> None:
        try:
            signed = SignedHeader.from_bytes(await receive_blob(reader, max_bytes=8192))
            author = signed.header.author
            pending = self._pushed.setdefault(author, {}) if self._gossip else {}
            if author != self.peer_id and self._gossip and len(pending) < MAX_PUSHED_PER_AUTHOR:
                pending[signed.header.seq] = signed.to_bytes()
                self._ensure_author_task(author)
        except (TransportError, EnvelopeError, OSError) as exc:
            logger.debug("notification from %s dropped: %s", info.peer_id, exc)
        finally:
            writer.close()

    async def _serve_state(self, info: Any, reader: Any, writer: Any) -> None:
        try:
            await receive_blob(reader, max_bytes=4096)
            if not self.config.serve_state:
                await send_refusal(writer, "this node does not serve state")
                return
            loop = asyncio.get_running_loop()
            blob = await loop.run_in_executor(None, self._state_blob)
            await send_blob(writer, blob)
            logger.info("served replica state (%.1f MB) to %s", len(blob) / 1e6, info.peer_id)
        except (TransportError, OSError) as exc:
            logger.debug("state request failed: %s", exc)
        finally:
            writer.close()

    def _state_blob(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(self.replica.state_dict(), buffer)
        return buffer.getvalue()

    # ---- state download ---------------------------------------------------------------------

    async def _download_state(self) -> TransferStats | None:
        deadline = time.monotonic() + 2 * self.config.heartbeat_period_s + 2
        while not self.peers and self.config.initial_peers and time.monotonic() < deadline:
            await self._poll()
            await asyncio.sleep(0.2)
        for donor in self._donors():
            started = time.perf_counter()
            try:
                blob = await self._request(donor.peer_id, "state", self.config.max_state_bytes)
                state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
                await asyncio.get_running_loop().run_in_executor(
                    self._merge_pool, self.replica.load_state_dict, state
                )
            except Exception as exc:  # an untrusted donor: try the next one
                self._reject("bad_state", donor.peer_id, str(exc))
                continue
            return TransferStats(len(blob), time.perf_counter() - started, donor.peer_id)
        return None

    def _donors(self) -> list[Heartbeat]:
        """Peers ahead of us that serve state, most advanced first; majority digest preferred."""
        ahead = [
            h
            for h in self.alive_peers()
            if h.serves_state and h.num_applied > self.replica.num_applied
        ]
        votes = Counter((h.num_applied, h.applied_digest) for h in self.alive_peers())
        return sorted(
            ahead,
            key=lambda h: (h.num_applied, votes[(h.num_applied, h.applied_digest)]),
            reverse=True,
        )


class _SeenSet:
    """A bounded set: counts each bad record once instead of on every poll."""

    def __init__(self, capacity: int) -> None:
        self._items: OrderedDict[int, None] = OrderedDict()
        self._capacity = capacity

    def add(self, item: int) -> bool:
        """True when `item` is new."""
        if item in self._items:
            return False
        self._items[item] = None
        if len(self._items) > self._capacity:
            self._items.popitem(last=False)
        return True
