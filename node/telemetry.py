"""What a node tells: events for the log, heartbeats for the swarm, status for the dashboard.

Figures written from two threads (the training loop, the swarm's merges) are kept in
`NodeStats`; the heartbeat is built from them, cheap enough for the swarm's event loop.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dht.heartbeat import (
    MAX_AUTHORS,
    MAX_LOSS,
    MAX_MADDRS,
    MAX_REJECTED_PEERS,
    MAX_REJECTED_REASONS,
    MAX_UPLINK,
    Heartbeat,
)
from dht.reachability import shareable
from dht.transport import UPLINK, WIRE_BYTES
from merge.codec_policy import AUTO, CodecChoice
from merge.pipeline import MergeResult, UpdatePipeline
from merge.replica import Replica
from merge.sketch import ReplicaSketch
from node.builders import HostFacts
from node.config import JoinConfig
from node.events import EventLog
from node.learner import RoundStats, StepStats
from node.round_size import RoundSizer
from node.snapshot import NodeStatus
from node.stats import NodeStats, ReplicaView
from node.swarm_link import SwarmLink

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundTimings:
    inner_s: float
    """From the round's start to its last inner step's end (across restarts)."""
    encode_s: float
    seal_s: float
    merge_s: float
    eval_s: float
    steps_s: float = 0.0
    """Of inner_s, the seconds inside the inner steps themselves (across restarts)."""

    @property
    def overhead_s(self) -> float:
        """Time spent on the round outside inner steps and evaluation (eval_s: handing a
        snapshot to the evaluation thread, or evaluating inline on a sharded learner)."""
        return self.encode_s + self.seal_s + self.merge_s


@dataclass(frozen=True)
class RoundReport:
    """One finished round, as `round_done` reports it."""

    stats: RoundStats
    val_loss: float | None
    timings: RoundTimings
    round_s: float
    seq: int | None
    planned_steps: int
    resumed_at_step: int
    learner_step: int
    update_bytes: int
    aside_s: float = 0.0
    """Seconds the finished round waited, set aside, for the swarm while the next round
    trained (node.trainer); not in round_s."""


class Resketcher:
    """Sketches the replica on its own thread whenever told it changed.

    The swarm reports peer merges from its event loop; sketching there would stall heartbeats
    and gossip. Until started (offline, or before joining) the caller sketches in place.
    """

    def __init__(self, record: Callable[[], None]) -> None:
        self._record = record
        self._dirty = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="resketch", daemon=True)
        self._thread.start()

    def changed(self) -> bool:
        """Ask for a new sketch; False if the thread is not running (sketch in place then)."""
        if self._thread is None or self._closed:
            return False
        self._dirty.set()
        return True

    def stop(self) -> None:
        self._closed = True
        self._dirty.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            self._dirty.wait()
            if self._closed:
                return
            self._dirty.clear()
            try:
                self._record()
            except Exception:  # a failed sketch must not end the node's sketching
                logger.exception("sketching the replica failed")


class Telemetry:
    """Reports rounds and merges, and answers heartbeats and status reads."""

    def __init__(
        self,
        *,
        config: JoinConfig,
        peer_id: str,
        fingerprint: str,
        host: HostFacts,
        codec: str,
        replica: Replica,
        pipeline: UpdatePipeline,
        swarm: SwarmLink,
        stats: NodeStats,
        round_sizer: RoundSizer,
        events: EventLog,
        facts: dict[str, object],
    ) -> None:
        """`facts`: what the `started` event says about the run, the model and the device."""
        self.config, self.peer_id, self.fingerprint = config, peer_id, fingerprint
        self._host, self._codec = host, codec
        self._picked = False
        self.replica, self.pipeline, self.swarm = replica, pipeline, swarm
        self.stats, self.round_sizer, self.events = stats, round_sizer, events
        self.sketcher = ReplicaSketch(replica.numel, fingerprint)
        self.resketcher = Resketcher(self.record_replica)
        self.started_at = time.monotonic()
        self._facts = facts
        self.uplink: Callable[[], float | None] = UPLINK.bytes_per_s
        """The measured uplink that status shows (this process's sends, as --codec auto's)."""

    # ---- events ----------------------------------------------------------------------------

    def started(self, round_: int, val_loss: float | None) -> None:
        self.events.emit("started", **self._facts, round=round_, val_loss=val_loss)

    def evaluated(self, round_: int, val_loss: float | None) -> None:
        """The validation loss of the replica after round `round_` (0 or the round resumed:
        at start), computed beside training (None: no validation)."""
        if val_loss is not None:
            self.events.emit("evaluated", round=round_, val_loss=val_loss)

    def codec_picked(self, choice: CodecChoice, uplink_bytes_per_s: float) -> None:
        """--codec auto chose `choice` at the measured uplink: round_done says the codec from
        now on; the event comes when the codec changes (and at the first choice)."""
        first, self._picked = not self._picked, True
        if first or choice.codec != self._codec:
            self.events.emit(
                "codec_picked",
                codec=choice.codec,
                uplink_bytes_per_s=round(uplink_bytes_per_s, 1),
                upload_s=round(choice.upload_s, 3),
                budget_s=round(choice.budget_s, 3),
                fits=choice.fits,
            )
        self._codec = choice.codec

    def stopped(self, reason: str) -> None:
        """The last event: with the replica as this node leaves it (its applied set, count and
        sketch), so a run can be judged from the nodes' own logs when the DHT is too slow."""
        self.record_replica()
        view = self.stats.snapshot().replica
        self.events.emit(
            "stopped",
            round=self.stats.round,
            reason=reason,
            seq=self.stats.seq,
            applied_digest=view.applied_digest,
            num_applied=view.num_applied,
            sketch=list(view.sketch),
        )

    def report_step(self, round_: int, step: int, planned_steps: int, stats: StepStats) -> None:
        self.events.progress(
            round=round_,
            step=step,
            inner_steps=planned_steps,
            loss=stats.loss,
            tokens_per_s=stats.tokens_per_s,
        )

    def report_merge(self, result: MergeResult) -> None:
        """Called for every update, own or peer's, from whichever thread merged it."""
        if not result.accepted:
            self.events.emit(
                "update_rejected", author=result.author, seq=result.seq, reason=result.reason
            )
            return
        self.stats.count_merge(result.staleness)
        if result.author != self.peer_id:
            # A fragment update (1 of P) stands for 1/P of its round's steps.
            steps = result.inner_steps / self.config.fragments
            self.round_sizer.observe_update(result.author, steps, time.monotonic())
        if not self.resketcher.changed():
            self.record_replica()
        self.events.emit(
            "update_merged",
            author=result.author,
            seq=result.seq,
            staleness=result.staleness,
            weight=round(result.weight, 6),
            learners=result.learners,
            blocks_corrected=result.blocks_corrected,
            robust=result.robust,
            num_applied=self.replica.num_applied,
        )

    def report_round(self, r: RoundReport) -> None:
        t, loss, tokens = r.timings, r.stats.loss, r.stats.tokens
        bytes_sent, bytes_received = WIRE_BYTES.totals()
        self.events.emit(
            "round_done",
            round=self.stats.round,
            seq=r.seq,
            steps=r.stats.num_steps,
            planned_steps=r.planned_steps,
            steps_per_s=_rounded(self.round_sizer.own_rate),
            resumed_at_step=r.resumed_at_step,
            learner_step=r.learner_step,
            loss=round(loss, 6),
            val_loss=r.val_loss,
            tokens=tokens,
            tokens_per_s=round(tokens / max(r.round_s, 1e-9), 1),
            num_applied=self.replica.num_applied,
            round_s=round(r.round_s, 4),
            aside_s=round(r.aside_s, 4),
            inner_s=round(t.inner_s, 4),
            steps_s=round(t.steps_s, 4),
            encode_s=round(t.encode_s, 5),
            seal_s=round(t.seal_s, 5),
            merge_s=round(t.merge_s, 5),
            eval_s=round(t.eval_s, 4),
            drift=self.drift(),
            peers_alive=len(self.swarm.alive_peers()),
            fresh_peers_set_aside=self.swarm.fresh_peers_set_aside(),  # at that same call
            lost=self.swarm.num_lost(),
            need_state=self.swarm.num_need_state(),
            codec=self._codec,
            update_bytes=r.update_bytes,
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
        )
        self.stats.finish_round(loss, r.val_loss, tokens / max(r.round_s, 1e-9))

    # ---- what the swarm sees ---------------------------------------------------------------

    def record_replica(self) -> None:
        """Sketch the replica where it changed (the merging thread), never in a heartbeat."""
        with self.replica.lock:
            digest = self.replica.applied_digest()
            sketch = self.sketcher.settled(self.replica)
            num_applied = self.replica.num_applied
            applied = self.replica.applied
        top = sorted(applied, key=lambda author: len(applied[author]), reverse=True)
        merged = tuple((author, len(applied[author])) for author in top[:MAX_AUTHORS])
        self.stats.record_replica(ReplicaView(digest, tuple(sketch), num_applied, merged))

    def drift(self) -> float | None:
        """Largest relative distance to a live peer's replica holding the same applied set."""
        return self.stats.drift(self.swarm.alive_peers())

    def heartbeat(self) -> Heartbeat:
        """Built from figures kept up to date elsewhere: cheap enough for the swarm's loop."""
        s = self.stats.snapshot()
        merged = self.pipeline.num_merged
        rejections = dict(self.pipeline.rejections)
        for reason, count in self.swarm.rejections().items():
            rejections[reason] = rejections.get(reason, 0) + count
        bytes_sent, bytes_received = WIRE_BYTES.totals()
        return Heartbeat(
            peer_id=self.peer_id,
            org=self.config.org,
            version=self._host.version,
            device=self._host.device,
            memory_gb=self._host.memory_gb,
            state=s.state,
            round=s.round,
            tokens_per_s=round(float(s.last_round.tokens_per_s), 1),
            steps_per_s=_rounded(self.round_sizer.own_rate) or 0.0,
            loss=reportable_loss(s.last_round.loss),
            val_loss=reportable_loss(s.last_round.val_loss),
            num_applied=s.replica.num_applied,
            applied_digest=s.replica.applied_digest,
            latest_seq=s.published_seq,
            updates_published=s.published_seq,
            updates_merged=merged,
            staleness_mean=round(s.staleness_sum / max(merged, 1), 4),
            drift=self.drift(),
            sketch=list(s.replica.sketch),
            uptime_s=round(time.monotonic() - self.started_at, 1),
            maddrs=shareable(self.swarm.visible_maddrs(), MAX_MADDRS),
            serves_state=self.config.serve_state,
            rejections=rejections,
            sent_at=time.time(),
            merged_by_author=dict(s.replica.merged_by_author),
            staleness_histogram=list(s.staleness_counts),
            heartbeat_period_s=self.config.heartbeat_period,
            num_lost=self.swarm.num_lost(),
            num_need_state=self.swarm.num_need_state(),
            num_realigned=s.num_realigned,
            paths=self.swarm.paths(),
            rejected_peers=self.pipeline.rejection_log.top(
                MAX_REJECTED_PEERS, MAX_REJECTED_REASONS
            ),
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
            codec=self._codec or None,
            codec_auto=self.config.codec == AUTO,
            uplink_bytes_per_s=_heartbeat_uplink(self.uplink()),
        )

    def status(self) -> NodeStatus:
        """One read-only picture of the node and the peers it sees (for the dashboard)."""
        own = self.heartbeat()  # its drift calls alive_peers: the count below is of now
        now = time.time()
        fetches, fetched_bytes = self.swarm.fetched()
        return NodeStatus(
            run_id=self.config.run_id,
            fingerprint=self.fingerprint,
            own=own,
            peers=self.swarm.sightings(now),
            fetches=fetches,
            fetched_bytes=fetched_bytes,
            taken_at=now,
            state_download=self.swarm.state_download(),
            fresh_peers_set_aside=self.swarm.fresh_peers_set_aside(),
            codec=self._codec,
            codec_auto=self.config.codec == AUTO,
            uplink_bytes_per_s=_rounded(self.uplink()),
        )


def _heartbeat_uplink(rate: float | None) -> float | None:
    """The measured uplink as a heartbeat carries it: six significant digits, within the
    bound peers accept (None: not measured, or not a finite figure)."""
    if rate is None or not math.isfinite(rate) or rate < 0:
        return None
    return _rounded(min(rate, MAX_UPLINK))


def _rounded(rate: float | None) -> float | None:
    """A rate to six significant digits (None stays None)."""
    return None if rate is None else float(f"{rate:.6g}")


def reportable_loss(loss: float | None) -> float | None:
    """A diverged loss (inf, nan, huge) is reported as unknown: peers refuse such heartbeats."""
    return loss if loss is not None and math.isfinite(loss) and 0 <= loss <= MAX_LOSS else None
