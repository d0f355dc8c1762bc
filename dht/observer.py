"""Read the swarm's state from the DHT without training: for `status` and the dashboard."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import dataclass, field

from hivemind import DHT
from hivemind.p2p import P2PDaemonError

from dht.heartbeat import Heartbeat, HeartbeatError
from dht.messages import (
    RUN_LISTING_KEY,
    MessageError,
    parse_run_listing,
    parse_run_record,
)
from dht.pages import Page, page_bounds
from dht.reaper import OrphanReaper
from dht.records import OwnerValidator, subkey_owner
from dht.shard_walk import walk_tree
from dht.shards import ShardConfig, shard_key
from dht.swarm_config import SwarmError
from dht.swarm_pages import SwarmSummary, summarize

logger = logging.getLogger(__name__)
MAX_LISTED_RUNS = 32
"""Runs `status` shows when no run id is given."""
MAX_SHARD_KEYS = 4096
"""Heartbeat shard keys one snapshot reads at most (a swarm of ~100,000 at 32 per shard)."""


@dataclass(frozen=True)
class PeerStatus:
    heartbeat: Heartbeat
    last_seen_s: float


@dataclass(frozen=True)
class SwarmSnapshot:
    run_id: str
    fingerprint: str
    run_summary: str
    peers: list[PeerStatus] = field(default_factory=list)
    rejected_heartbeats: int = 0
    shards: dict[str, int] = field(default_factory=dict)
    """Shard prefix -> heartbeats read there (`dht.shard_walk.TreeWalk.leaves`); the legacy
    single key, when it holds any, as "peers"."""

    def summary(self) -> SwarmSummary:
        """Swarm-wide aggregates over every peer read (what `status` and the dashboard show
        above one page of peers)."""
        return summarize(self.run_id, [p.heartbeat for p in self.peers], self.shards)

    def page(self, number: int, size: int) -> tuple[Page, list[PeerStatus]]:
        """Page `number` (from 1, clamped to the last) of `size` peers, in the order of `peers`."""
        page = page_bounds(len(self.peers), number, size)
        return page, self.peers[page.start : page.stop]


class SwarmObserver:
    """A client-mode DHT member that reads run records and heartbeats.

    Its DHT process (and that process's p2pd) is reaped even if this process is killed.
    """

    def __init__(self, initial_peers: list[str], *, timeout_s: float = 30.0) -> None:
        self._reaper = OrphanReaper()
        self._reaper.start()
        try:
            self._dht = _start_dht(initial_peers, timeout_s)
        # RuntimeError: hivemind's "DHTNode bootstrap failed: none of the initial_peers
        # responded to a ping" (a bootstrap whose p2pd answers but whose DHT is slow or stalled)
        except (P2PDaemonError, TimeoutError, RuntimeError) as exc:
            self._reaper.close()
            reason = str(exc).splitlines()[-1] if str(exc) else type(exc).__name__
            raise SwarmError(
                f"could not reach the swarm through {', '.join(initial_peers)}: {reason}"
            ) from None
        if self._dht.pid is not None:
            self._reaper.watch(self._dht.pid)

    def run_ids(self, limit: int = MAX_LISTED_RUNS) -> list[str]:
        """The run ids trained in this DHT (sorted; at most `limit`), malformed ones ignored."""
        found = set()
        for subkey in self._get(RUN_LISTING_KEY):
            try:
                found.add(parse_run_listing(subkey))
            except MessageError as exc:
                logger.info("ignoring a listed run: %s", exc)
        return sorted(found)[:limit]

    def snapshot(self, run_id: str) -> list[SwarmSnapshot]:
        """One snapshot per configuration seen under `run_id` (normally exactly one)."""
        runs = []
        for fingerprint, summary in self._get(f"diloco-run/{run_id}").items():
            try:
                runs.append(parse_run_record(fingerprint, summary))
            except MessageError as exc:
                logger.info("ignoring a run record: %s", exc)
        return [self._read_run(run_id, r.fingerprint, json.dumps(r.summary)) for r in runs]

    def _read_run(self, run_id: str, fingerprint: str, summary: str) -> SwarmSnapshot:
        now = time.time()
        newest: dict[str, Heartbeat] = {}
        rejected = 0
        records, shards = self._heartbeat_records(run_id, f"diloco/{fingerprint[:16]}")
        for subkey, blob in records:
            peer_id = subkey_owner(subkey)
            try:
                if peer_id is None:
                    raise HeartbeatError("malformed", "a heartbeat record's subkey names no owner")
                heartbeat = Heartbeat.verify(blob, peer_id)
            except HeartbeatError as exc:
                logger.info("ignoring heartbeat from %s: %s", peer_id, exc)
                rejected += 1
                continue
            if peer_id not in newest or heartbeat.sent_at > newest[peer_id].sent_at:
                newest[peer_id] = heartbeat  # a peer in two shards while it moves
        peers = [PeerStatus(h, max(0.0, now - h.sent_at)) for h in newest.values()]
        peers.sort(key=lambda p: (p.heartbeat.org, p.heartbeat.peer_id))
        return SwarmSnapshot(run_id, fingerprint, summary, peers, rejected, shards)

    def _heartbeat_records(
        self, run_id: str, prefix: str
    ) -> tuple[list[tuple[object, object]], dict[str, int]]:
        """Every heartbeat record of the run: the shard tree walked from its root (each
        split key's two children, at most MAX_SHARD_KEYS keys), then the legacy key; and
        the heartbeats found per shard."""
        walk = walk_tree(
            run_id,
            lambda shard: self._get(f"{prefix}/{shard_key(shard)}"),
            max_keys=MAX_SHARD_KEYS,
            max_depth=ShardConfig().max_depth,
        )
        if walk.truncated:
            logger.info("read the first %d heartbeat shards of %s only", MAX_SHARD_KEYS, run_id)
        legacy = self._get(f"{prefix}/peers")
        shards = {**walk.leaves, **({"peers": len(legacy)} if legacy else {})}
        return [*walk.records, *legacy.items()], shards

    def _get(self, key: str) -> dict[object, object]:
        found = self._dht.get(key, latest=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        return {subkey: item.value for subkey, item in found.value.items()}

    def close(self) -> None:
        try:
            self._dht.shutdown()
        finally:
            self._reaper.close()

    def __enter__(self) -> SwarmObserver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _start_dht(initial_peers: list[str], timeout_s: float) -> DHT:
    """The DHT forks: without a SIGTERM handler of this process, the child could ignore it."""
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL) if in_main else None
    try:
        return DHT(
            initial_peers=initial_peers,
            client_mode=True,
            record_validators=[OwnerValidator()],  # reads owner-signed heartbeats only
            start=True,
            startup_timeout=timeout_s,
            shutdown_timeout=3,
        )
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
