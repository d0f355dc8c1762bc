"""Bounded history for the charts: ring buffers fed by heartbeats and, embedded, by events."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from typing import Any, TypeVar

from dashboard.models import (
    HistoryOut,
    PeerPoint,
    PeerSeries,
    RatePoint,
    SwarmPoint,
    TimelineEvent,
    TimelineKind,
)
from dashboard.settings import DashboardSettings
from dashboard.view import SwarmState, totals

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PEER_SERIES = 256
"""Peers whose loss series are kept; the one heard from least recently goes first."""
RATE_WINDOW_S = 60.0


class History:
    """Thread-safe: data sources write from their thread, routes read from theirs."""

    def __init__(self, settings: DashboardSettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._swarm: deque[SwarmPoint] = deque(maxlen=settings.history_points)
        self._peers: OrderedDict[str, tuple[str, deque[PeerPoint]]] = OrderedDict()
        self._timeline: deque[TimelineEvent] = deque(maxlen=settings.timeline_events)

    # ---- writing ------------------------------------------------------------------------------

    def sample(self, state: SwarmState) -> None:
        """One swarm point, and a loss point for every peer that finished a new round."""
        t = totals(state)
        point = SwarmPoint(
            t=round(state.taken_at, 3),
            peers_alive=t.peers_alive,
            tokens_per_s=t.tokens_per_s,
            num_applied=max((h.num_applied for h in state.alive), default=0),
            updates_merged=t.updates_merged,
            updates_published=t.updates_published,
            goodput=t.goodput,
            drift=t.drift,
            val_loss=t.val_loss,
            fresh_peers_set_aside=t.fresh_peers_set_aside,
        )
        with self._lock:
            self._swarm.append(point)
        for record in state.peers:
            h = record.heartbeat
            if record.alive and h.round > 0:
                arrived = state.taken_at - record.last_seen_s  # this clock, not the peer's
                self.add_peer_point(
                    h.peer_id, h.org, h.round, h.loss, h.val_loss, h.tokens_per_s, t=arrived
                )

    def add_peer_point(
        self,
        peer_id: str,
        org: str,
        round_: int,
        loss: float | None,
        val_loss: float | None,
        tokens_per_s: float,
        *,
        t: float,
    ) -> None:
        """One point per round: a new round appends, new figures for the same round replace."""
        with self._lock:
            known = self._peers.pop(peer_id, None)
            points = known[1] if known else deque(maxlen=self._settings.peer_points)
            org = org or (known[0] if known else "")
            self._peers[peer_id] = (org, points)  # the most recently heard from last
            point = PeerPoint(
                t=round(t, 3), round=round_, loss=loss, val_loss=val_loss, tokens_per_s=tokens_per_s
            )
            last = points[-1] if points else None
            if last is None or round_ > last.round:
                points.append(point)
            elif round_ == last.round and (loss, val_loss) != (last.loss, last.val_loss):
                # A heartbeat sent while the round was being evaluated carried the previous
                # round's losses: the round's own figures replace them.
                points[-1] = point.model_copy(update={"t": last.t})
            while len(self._peers) > MAX_PEER_SERIES:
                self._peers.popitem(last=False)

    def add_event(self, kind: TimelineKind, peer_id: str, detail: str, *, t: float) -> None:
        with self._lock:
            self._timeline.append(
                TimelineEvent(t=round(t, 3), kind=kind, peer_id=peer_id, detail=detail)
            )

    # ---- reading ------------------------------------------------------------------------------

    def to_out(self, max_points: int | None = None) -> HistoryOut:
        """Everything kept; with max_points, each series thinned evenly to at most that many."""
        with self._lock:
            swarm = list(self._swarm)
            peers = [(pid, org, list(points)) for pid, (org, points) in self._peers.items()]
            timeline = list(self._timeline)
        rates = merges_per_minute(swarm)
        return HistoryOut(
            swarm=_thin(swarm, max_points),
            peers=[
                PeerSeries(peer_id=pid, org=org, points=_thin(points, max_points))
                for pid, org, points in peers
            ],
            merges_per_minute=_thin(rates, max_points),
            timeline=timeline,
        )


def merges_per_minute(points: list[SwarmPoint]) -> list[RatePoint]:
    """Growth of the largest live applied count over the preceding minute (never negative)."""
    rates = []
    start = 0
    for point in points:
        while point.t - points[start].t > RATE_WINDOW_S:
            start += 1
        first = points[start]
        elapsed = point.t - first.t
        if elapsed > 0:
            per_min = max(0, point.num_applied - first.num_applied) * 60.0 / elapsed
            rates.append(RatePoint(t=point.t, updates_per_min=round(per_min, 2)))
    return rates


def _thin(items: list[T], max_points: int | None) -> list[T]:
    if max_points is None or len(items) <= max_points:
        return items
    step = len(items) / max_points
    picked = [items[int(i * step)] for i in range(max_points - 1)]
    return [*picked, items[-1]]


class EventRecorder:
    """Keeps a node's notable events for the page: joins, leaves, rejections, its own start and
    stop, and a loss point per round. Each at the time it was emitted, which for an event the
    node emitted before its dashboard was built (node.dashboard_seam) is earlier than now."""

    def __init__(self, history: History, local_peer_id: str) -> None:
        self._history = history
        self._local = local_peer_id

    def record(self, event: str, fields: dict[str, Any], *, t: float) -> None:
        try:
            self._record(event, fields, t)
        except Exception as exc:  # the dashboard must never cost the node an event
            logger.warning("dashboard could not record %s: %s", event, exc)

    def _record(self, event: str, f: dict[str, Any], now: float) -> None:
        add = self._history.add_event
        if event == "peer_joined":
            add("joined", str(f["peer_id"]), _org_detail(f.get("org")), t=now)
        elif event == "peer_left":
            add("left", str(f["peer_id"]), "silent for three heartbeat periods", t=now)
        elif event == "update_rejected":
            add("rejected", str(f["author"]), f"update {f['seq']} rejected: {f['reason']}", t=now)
        elif event == "started":
            add("joined", self._local, f"this node started training at round {f['round']}", t=now)
        elif event == "stopped":
            add("left", self._local, f"this node stopped ({f['reason']})", t=now)
        elif event == "state_downloaded":
            detail = f"downloaded the replica ({f['megabytes']} MB) from {f['peer_id']}"
            add("info", self._local, detail, t=now)
        elif event == "round_done":
            self._history.add_peer_point(
                self._local, "", f["round"], f["loss"], f["val_loss"], f["tokens_per_s"], t=now
            )


def _org_detail(org: object) -> str:
    return f"org {org}" if org else "joined the swarm"
