"""What a node counts about itself, behind one lock.

The learner thread (rounds, own merges) and the swarm's threads (peer merges, heartbeats,
the dashboard) all write or read these figures; every access goes through `NodeStats`.
The expensive part of a heartbeat, the replica's sketch, is computed where the replica
changed (in the merging thread) and kept here, so that building a heartbeat is cheap.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from dht.heartbeat import STALENESS_BUCKETS, Heartbeat, staleness_bucket
from merge.sketch import relative_distance

MAX_SKETCHES = 256
"""Sketches kept per applied digest, to compare with peers that lag behind."""


@dataclass(frozen=True)
class ReplicaView:
    """The replica as of its last change: a consistent (digest, sketch, counts) triple."""

    applied_digest: str = ""
    sketch: tuple[float, ...] = ()
    num_applied: int = 0
    merged_by_author: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class LastRound:
    loss: float | None = None
    val_loss: float | None = None
    tokens_per_s: float = 0.0


@dataclass(frozen=True)
class StatsSnapshot:
    """One consistent copy of every figure, for heartbeats and the dashboard."""

    state: str
    round: int
    seq: int
    published_seq: int
    last_round: LastRound
    staleness_sum: int
    staleness_counts: tuple[int, ...]
    replica: ReplicaView
    num_realigned: int = 0


class NodeStats:
    """Counters and the replica's sketches; every method takes the one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "syncing"
        self._round = 0
        self._seq = 0
        self._published_seq = 0
        self._last_round = LastRound()
        self._staleness_sum = 0
        self._staleness_counts = [0] * len(STALENESS_BUCKETS)
        self._replica = ReplicaView()
        self._sketches: OrderedDict[str, list[float]] = OrderedDict()
        self._num_realigned = 0

    # ---- written by the learner thread -----------------------------------------------------

    def set_state(self, state: str) -> None:
        with self._lock:
            self._state = state

    def set_round(self, round_: int) -> None:
        with self._lock:
            self._round = round_

    def set_seq(self, seq: int, *, published: bool = False) -> None:
        with self._lock:
            self._seq = seq
            if published:
                self._published_seq = seq

    def set_published_seq(self, seq: int) -> None:
        with self._lock:
            self._published_seq = seq

    def finish_round(self, loss: float, val_loss: float | None, tokens_per_s: float) -> None:
        with self._lock:
            self._last_round = LastRound(loss, val_loss, tokens_per_s)

    # ---- written by whichever thread merged an update --------------------------------------

    def count_merge(self, staleness: int) -> None:
        with self._lock:
            self._staleness_sum += staleness
            self._staleness_counts[staleness_bucket(max(0, staleness))] += 1

    def record_replica(self, view: ReplicaView) -> None:
        with self._lock:
            self._replica = view
            self._sketches[view.applied_digest] = list(view.sketch)
            self._sketches.move_to_end(view.applied_digest)
            while len(self._sketches) > MAX_SKETCHES:
                self._sketches.popitem(last=False)

    def count_realigned(self) -> None:
        """The replica took a peer's parameters (dht.realign): the sketches kept of its earlier
        ones, but the current applied set's, describe a replica that is gone; drift is no
        longer measured against them."""
        with self._lock:
            self._num_realigned += 1
            current = self._replica.applied_digest
            for digest in [d for d in self._sketches if d != current]:
                del self._sketches[digest]

    # ---- read from any thread --------------------------------------------------------------

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    @property
    def round(self) -> int:
        with self._lock:
            return self._round

    @property
    def seq(self) -> int:
        with self._lock:
            return self._seq

    @property
    def published_seq(self) -> int:
        with self._lock:
            return self._published_seq

    @property
    def last_round(self) -> LastRound:
        with self._lock:
            return self._last_round

    def drift(self, peers: list[Heartbeat]) -> float | None:
        """Largest relative distance to a peer's replica holding an applied set we held too."""
        with self._lock:
            pairs = [
                (h.sketch, self._sketches[h.applied_digest])
                for h in peers
                if h.applied_digest in self._sketches
            ]
        known = [d for d in (relative_distance(a, b) for a, b in pairs) if d is not None]
        return round(max(known), 6) if known else None

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(
                state=self._state,
                round=self._round,
                seq=self._seq,
                published_seq=self._published_seq,
                last_round=self._last_round,
                staleness_sum=self._staleness_sum,
                staleness_counts=tuple(self._staleness_counts),
                replica=self._replica,
                num_realigned=self._num_realigned,
            )
