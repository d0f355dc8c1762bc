"""`diloco-node dashboard`: a client-mode DHT member that reads heartbeats and trains nothing.

No node is special: the swarm is whatever signed heartbeats the DHT holds under the run id.
Liveness and the timeline are derived here, from when each peer's heartbeat last changed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dashboard.app import create_app
from dashboard.history import History
from dashboard.models import Mode
from dashboard.server import DashboardServer, check_free
from dashboard.settings import DashboardSettings, StandaloneConfig
from dashboard.sources import PolledSource
from dashboard.view import PeerRecord, SwarmState
from dht.heartbeat import Heartbeat
from dht.observer import SwarmObserver, SwarmSnapshot
from merge.allowlist import AllowList
from node.config import JoinConfig
from node.events import EventLog

DEFAULT_HEARTBEAT_PERIOD_S = 5.0
"""Assumed for heartbeats that do not say their period."""
MAX_TRACKED_PEERS = 1024
"""Dead peers beyond this many are forgotten, the longest silent first."""


class Observer(Protocol):
    def snapshot(self, run_id: str) -> list[SwarmSnapshot]: ...


@dataclass
class _Tracked:
    heartbeat: Heartbeat
    last_seen: float
    """Local time at which a new heartbeat of this peer was last read."""
    alive: bool = True


class StandaloneSource(PolledSource):
    """A peer is alive while its heartbeat changes at least every three of its periods."""

    mode: Mode = "standalone"

    def __init__(
        self,
        observer: Observer,
        run_id: str,
        settings: DashboardSettings,
        history: History,
        *,
        clock: Callable[[], float] = time.time,
        allowlist: AllowList | None = None,
    ) -> None:
        super().__init__(run_id, settings, history)
        self._observer = observer
        self._clock = clock
        self._allowlist = allowlist
        self._fingerprint = ""
        self._tracked: dict[str, _Tracked] = {}

    def read(self) -> SwarmState:
        snapshot = self._choose(self._observer.snapshot(self.run_id))
        now = self._clock()
        for peer in snapshot.peers if snapshot is not None else []:
            heartbeat = self._admitted(peer.heartbeat)
            if heartbeat is not None:
                self._see(heartbeat, now)
        for peer_id, tracked in self._tracked.items():
            if tracked.alive and now - tracked.last_seen > self._alive_window_s(tracked):
                tracked.alive = False
                self.history.add_event("left", peer_id, "silent for three heartbeat periods", t=now)
        self._forget_oldest_dead()
        peers = [
            PeerRecord(t.heartbeat, t.alive, now - t.last_seen)
            for t in sorted(self._tracked.values(), key=_order)
        ]
        shards = snapshot.shards if snapshot is not None else {}
        return SwarmState(self.run_id, self._fingerprint, self.mode, peers, now, shards)

    def _admitted(self, heartbeat: Heartbeat) -> Heartbeat | None:
        """Permissioned: listed peers only, under the organization the allow list gives them."""
        if self._allowlist is None:
            return heartbeat
        org = self._allowlist.org_of(heartbeat.peer_id)
        return None if org is None else dataclasses.replace(heartbeat, org=org)

    def _choose(self, snapshots: list[SwarmSnapshot]) -> SwarmSnapshot | None:
        """The configuration with the most peers (normally the only one) under the run id."""
        if not snapshots:
            return None
        best = max(snapshots, key=lambda s: (len(s.peers), s.fingerprint == self._fingerprint))
        if best.fingerprint != self._fingerprint:
            self._fingerprint, self._tracked = best.fingerprint, {}
        return best

    def _see(self, heartbeat: Heartbeat, now: float) -> None:
        tracked = self._tracked.get(heartbeat.peer_id)
        if tracked is None or not tracked.alive:
            if tracked is None or heartbeat.sent_at > tracked.heartbeat.sent_at:
                detail = f"org {heartbeat.org}" if heartbeat.org else "joined the swarm"
                self.history.add_event("joined", heartbeat.peer_id, detail, t=now)
                self._tracked[heartbeat.peer_id] = _Tracked(heartbeat, now)
            return
        if heartbeat.sent_at > tracked.heartbeat.sent_at:
            self._note_rejections(tracked.heartbeat, heartbeat, now)
            tracked.heartbeat, tracked.last_seen = heartbeat, now

    def _note_rejections(self, before: Heartbeat, after: Heartbeat, now: float) -> None:
        grown = {
            reason: count - before.rejections.get(reason, 0)
            for reason, count in after.rejections.items()
            if count > before.rejections.get(reason, 0)
        }
        if grown:
            detail = ", ".join(f"{n} {reason}" for reason, n in sorted(grown.items()))
            self.history.add_event("rejected", after.peer_id, f"rejected {detail}", t=now)

    def _alive_window_s(self, tracked: _Tracked) -> float:
        period = tracked.heartbeat.heartbeat_period_s or DEFAULT_HEARTBEAT_PERIOD_S
        return 3 * max(period, self.settings.poll_period_s)

    def _forget_oldest_dead(self) -> None:
        excess = len(self._tracked) - MAX_TRACKED_PEERS
        if excess <= 0:
            return
        dead = sorted((t.last_seen, pid) for pid, t in self._tracked.items() if not t.alive)
        for _, peer_id in dead[:excess]:
            del self._tracked[peer_id]


def _order(tracked: _Tracked) -> tuple[bool, str, str]:
    return (not tracked.alive, tracked.heartbeat.org, tracked.heartbeat.peer_id)


def choose_run(run_ids: list[str]) -> str:
    """The run a dashboard without --run-id shows: the only one found, or the default run
    while none is; several are a one-line error naming them."""
    if len(run_ids) > 1:
        raise ValueError(
            f"this swarm trains several runs ({', '.join(run_ids)}): choose one with --run-id"
        )
    return run_ids[0] if run_ids else JoinConfig.run_id


def serve(config: StandaloneConfig, events: EventLog, stop: threading.Event) -> None:
    """Join the DHT as a client, serve the dashboard until `stop` is set, then leave."""
    settings = config.settings()
    check_free(settings.host, settings.port)  # before the DHT's seconds of start-up
    assert config.peers is not None
    with SwarmObserver(config.peers) as observer:
        run_id = config.run_id or choose_run(observer.run_ids())
        allowlist = AllowList.load(config.allow_keys) if config.allow_keys else None
        source = StandaloneSource(
            observer, run_id, settings, History(settings), allowlist=allowlist
        )
        server = DashboardServer(create_app(source, settings), settings.host, settings.port)
        source.start()
        try:
            url = server.start()
            events.emit("dashboard", url=url, run_id=run_id, peers=config.peers)
            while not stop.wait(0.5):
                pass
        finally:
            server.stop()
            source.stop()
