"""A node: wires the learner, the replica and the update pipeline together and runs rounds."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from dht.addresses import join_hint
from dht.heartbeat import (
    MAX_AUTHORS,
    MAX_LOSS,
    MAX_REJECTED_PEERS,
    MAX_REJECTED_REASONS,
    Heartbeat,
)
from dht.known_peers import join_peers, remember_peers
from dht.membership import count_learners
from dht.swarm import RunMismatchError, Swarm
from dht.transport import WIRE_BYTES
from merge.allowlist import AllowList
from merge.codecs import get_codec
from merge.correction import expected_delay, look_ahead
from merge.envelope import seal
from merge.feedback import Compressor
from merge.identity import Identity
from merge.pipeline import MergeResult, UpdatePipeline
from merge.rejections import RejectionLog
from merge.sketch import ReplicaSketch
from node.builders import (
    build_learner,
    build_replica,
    build_run_spec,
    build_validation,
    configure_torch,
    host_facts,
    merge_config_from,
    swarm_config_from,
)
from node.checkpoint import CheckpointError, Layout, load_checkpoint, save_checkpoint
from node.config import JoinConfig
from node.data import load_corpus, split_corpus
from node.events import EventLog
from node.fingerprint import describe_differences, fingerprint_settings, join_arguments
from node.learner import RoundStats, StepStats, resolve_device
from node.lifecycle import adopt_legacy_checkpoint, preflight
from node.locks import checkpoint_lock, lock_identity
from node.model import build_model
from node.progress import RoundProgress
from node.round_size import PeerRate, RoundSizeConfig, RoundSizer
from node.seq_ledger import SeqLedger
from node.snapshot import NodeStatus, PeerSighting
from node.stats import LastRound, NodeStats, ReplicaView
from node.streaming import FragmentCompressors, FragmentStream

if TYPE_CHECKING:
    from dashboard.embedded import EmbeddedDashboard

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 15.0
"""How long a stopping node waits for its own update to be announced and pushed to peers."""

__all__ = ["Node", "RoundTimings", "merge_config_from"]


@dataclass(frozen=True)
class RoundTimings:
    inner_s: float
    encode_s: float
    seal_s: float
    merge_s: float
    eval_s: float

    @property
    def overhead_s(self) -> float:
        """Time spent on the round outside inner steps and evaluation."""
        return self.encode_s + self.seal_s + self.merge_s


@dataclass(frozen=True)
class _Published:
    """One update this node sealed and submitted (a whole-model one or a fragment)."""

    result: MergeResult
    update_bytes: int
    """Bytes of the signed envelope, 0 when our own pipeline refused it (not published)."""
    encode_s: float
    seal_s: float
    merge_s: float


class _Resketcher:
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


class Node:
    """One learner with its replica of the global model."""

    def __init__(self, config: JoinConfig, events: EventLog) -> None:
        identity_path, held = lock_identity(
            config.identity_path, is_default=config.identity is None
        )
        if identity_path != config.identity_path:
            logger.warning(
                "identity %s is in use by another node on this machine; this node runs as %s",
                config.identity_path,
                identity_path,
            )
            config = replace(config, identity=str(identity_path))
        self.config = config
        self._locks = [held]
        try:
            self._build(config, events)
        except BaseException:
            self.close()
            raise

    def _build(self, config: JoinConfig, events: EventLog) -> None:
        self.identity, _ = Identity.load_or_create(config.identity_path)
        self.peer_id = self.identity.peer_id
        self.checkpoint_dir = config.checkpoint_path(self.peer_id)
        self._locks.append(checkpoint_lock(self.checkpoint_dir).acquire())
        self._moved_checkpoint = adopt_legacy_checkpoint(config, self.peer_id)
        self.device = resolve_device(config.device)
        configure_torch(config)
        self.corpus = load_corpus(config.data)
        split = split_corpus(self.corpus)
        self.spec = build_run_spec(config, self.corpus)
        self.model_config, self.merge_config = self.spec.model, self.spec.merge
        self.fingerprint = self.spec.fingerprint
        # Beside the identity (held under its lock): the seqs it sealed, per run.
        seqs_path = config.identity_path.with_name(config.identity_path.name + ".seqs")
        self.seq_ledger = SeqLedger(seqs_path, self.fingerprint)
        self.run_settings = fingerprint_settings(config, self.corpus)
        model = build_model(self.model_config, config.seed)
        self.replica = build_replica(model, self.merge_config, config.fragments)
        self.num_params = self.replica.numel
        self.pipeline = UpdatePipeline(self.replica, self.merge_config, self.fingerprint)
        self.codec = get_codec(config.codec)
        # Error feedback for the lossy codecs: what a payload drops goes into the next round's.
        self.compressor = Compressor(self.codec, self.num_params)
        layout = self.replica.layout
        # Streaming fragments (--fragments P > 1): per-fragment error feedback and rounds.
        self.fragment_compressors = (
            None if layout is None else FragmentCompressors(self.codec, layout)
        )
        self._stream: FragmentStream | None = None
        self._round_published: list[_Published] = []
        self.learner = build_learner(config, self.spec, model, split, self.peer_id, self.device)
        self.val_batches = build_validation(config, self.spec, split)
        self.stats = NodeStats()
        # Measured and reported always (peers may size by it); sizes rounds with --dynamic-h.
        self.round_sizer = RoundSizer(RoundSizeConfig(max_steps=config.inner_steps))
        self._round_steps = config.inner_steps
        self.sketcher = ReplicaSketch(self.num_params, self.fingerprint)
        self._host = host_facts(self.device)
        self._stop = threading.Event()
        self._started_at = time.monotonic()
        self.dashboard = self._build_dashboard()
        self.events = self.dashboard.tee(events) if self.dashboard is not None else events
        self.allowlist = AllowList.load(config.allow_keys) if config.allow_keys else None
        self.swarm = self._build_swarm() if config.swarm else None
        self._apply_allowlist()
        self._resketcher = _Resketcher(self._record_replica)
        self._partial: RoundProgress | None = None
        self._delay = 0.0
        """Swarm rounds our last update took to land (merge.correction.expected_delay)."""
        self._step_offset = 0
        self._record_replica()

    def _build_dashboard(self) -> EmbeddedDashboard | None:
        c = self.config
        if c.dashboard_port is None:
            return None
        # The dashboard sits above node/: imported only when asked for. It sees the node only
        # through `status()`, and imports nothing of node.runtime.
        from dashboard.embedded import EmbeddedDashboard

        return EmbeddedDashboard(
            host=c.dashboard_host,
            port=c.dashboard_port,
            token=c.dashboard_token,
            run_id=c.run_id,
            peer_id=self.peer_id,
            status=self.status,
        )

    def _apply_allowlist(self) -> None:
        """Permissioned run: only listed keys contribute, shown under the file's organization."""
        if self.allowlist is None:
            return
        self.pipeline.admit = self.allowlist.allows
        if self.swarm is not None:
            self.swarm.membership.admit = self.allowlist.allows
            self.swarm.membership.org_of = self.allowlist.org_of

    def _build_swarm(self) -> Swarm:
        port = preflight(self.config)
        config = swarm_config_from(self.config, self.spec, self.num_params, port, self.run_settings)
        # known-peers hook: the bootstrap, retried, and the peers this node knew last run
        config = replace(
            config, initial_peers=join_peers(config.initial_peers, self.checkpoint_dir)
        )
        return Swarm(
            config,
            self.identity,
            self.replica,
            self.pipeline,
            heartbeat_fn=self.heartbeat,
            on_merge=self.report_merge,
            on_event=self.events.emit,
        )

    # ---- figures written from two threads, kept in self.stats ------------------------------

    @property
    def round(self) -> int:
        return self.stats.round

    @round.setter
    def round(self, value: int) -> None:
        self.stats.set_round(value)

    @property
    def seq(self) -> int:
        return self.stats.seq

    @seq.setter
    def seq(self, value: int) -> None:
        self.stats.set_seq(value)

    @property
    def published_seq(self) -> int:
        return self.stats.published_seq

    @published_seq.setter
    def published_seq(self, value: int) -> None:
        self.stats.set_published_seq(value)

    @property
    def state(self) -> str:
        return self.stats.state

    @state.setter
    def state(self, value: str) -> None:
        self.stats.set_state(value)

    @property
    def last_round(self) -> LastRound:
        return self.stats.last_round

    # ---- lifecycle -------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Release the identity and checkpoint dir for another node (run() does it at exit)."""
        for lock in reversed(self._locks):
            lock.release()

    def run(self) -> None:
        if self._moved_checkpoint is not None:
            moved = str(self._moved_checkpoint)
            self.events.emit("checkpoint_moved", src=moved, path=str(self.checkpoint_dir))
        self._resume()
        try:
            if self.swarm is not None:
                self.join_swarm()
            self._start_dashboard()
            self._train()
        finally:
            self.state = "idle"
            if self.dashboard is not None:
                self.dashboard.stop()
            if self.swarm is not None:
                self._drain_publishes()
                self.swarm.shutdown()
            self._resketcher.stop()
            self.close()

    def _drain_publishes(self) -> None:
        """Let an update being published reach the swarm before leaving (bounded)."""
        assert self.swarm is not None
        left = self.swarm.drain(DRAIN_TIMEOUT_S)
        if left:
            logger.warning(
                "%d own update(s) still being published after %.0f s; leaving without them",
                left,
                DRAIN_TIMEOUT_S,
            )

    def _start_dashboard(self) -> None:
        """Once the swarm's DHT process has forked: no server thread may hold a lock then."""
        if self.dashboard is None:
            return
        url = self.dashboard.start()
        logger.info("dashboard at %s", url)
        self.events.emit("dashboard", url=url)

    def join_swarm(self) -> None:
        assert self.swarm is not None
        try:
            maddrs = self.swarm.start()
        except RunMismatchError as exc:
            differences = describe_differences(exc.theirs, self.run_settings)
            raise RunMismatchError(
                f"run '{self.config.run_id}' in this swarm uses a different model or run "
                f"configuration ({differences}); join with the command its nodes print, "
                "or pick another --run-id"
            ) from None
        extra = join_arguments(self.run_settings)
        self.events.emit(
            "listening",
            peer_id=self.peer_id,
            maddrs=maddrs,
            join_command=join_hint(maddrs, extra),
        )
        stats = self.swarm.download_state()
        if stats is not None:
            self.events.emit(
                "state_downloaded",
                peer_id=stats.peer_id,
                num_applied=self.replica.num_applied,
                megabytes=round(stats.num_bytes / 1e6, 3),
                seconds=round(stats.seconds, 3),
                mb_per_s=round(stats.mb_per_s, 2),
                unannounced=stats.unannounced,
                **self.pipeline.window_sizes(),  # what it took over to judge updates by
            )
        # A node that rejoins with the same identity continues its seq numbers.
        self.seq = max(
            self.seq,
            self.replica.last_seq(self.peer_id),
            self.swarm.announced_seq(),
            self.seq_ledger.last(),
        )
        self.published_seq = self.seq
        self._record_replica()
        self._resketcher.start()  # after the DHT's fork: no thread of ours may exist then
        self.swarm.start_gossip()

    def _train(self) -> None:
        self.state = "training"
        self.events.emit(
            "started",
            run_id=self.config.run_id,
            fingerprint=self.fingerprint,
            peer_id=self.peer_id,
            model=self.config.model,
            num_params=self.num_params,
            device=str(self.device),
            data=self.corpus.source,
            round=self.round,
            val_loss=self._evaluate_replica(),
        )
        reason = "interrupted"
        while not self._stop.is_set():
            if self._rounds_exhausted():
                reason = "max_rounds"
                break
            if self._time_exhausted():
                reason = "max_time"
                break
            completed = self.run_round() is not None
            if completed and self.round % self.config.checkpoint_every == 0:
                self.save_checkpoint()
        if reason != "interrupted":
            self._linger()
        self.save_checkpoint()
        self.events.emit("stopped", round=self.round, reason=reason, seq=self.seq)

    def _linger(self) -> None:
        """Keep serving and merging for --linger seconds, so peers still get our last update
        and we get theirs; with --linger-until-done, only until every live peer has finished,
        its last update is merged here and ours there."""
        if self.swarm is None or not self.config.linger:
            return
        self.state = "idle"
        self.events.emit("lingering", seconds=self.config.linger)
        started = time.monotonic()
        deadline = started + self.config.linger
        # A peer's heartbeat says idle one period after it published its last update at most.
        settle_s = 2 * self.config.heartbeat_period
        while not self._stop.wait(min(settle_s, max(deadline - time.monotonic(), 0.0))):
            own = len(self.replica.applied.get(self.peer_id, ()))
            peers = self.swarm.alive_peers()
            swarm_done = self.config.linger_until_done and peers_finished(
                peers, self.replica.last_seq, self.peer_id, own
            )
            if swarm_done or time.monotonic() >= deadline:
                break
        self.events.emit("lingered", seconds=round(time.monotonic() - started, 2))

    def _rounds_exhausted(self) -> bool:
        return self.config.max_rounds is not None and self.round >= self.config.max_rounds

    def _time_exhausted(self) -> bool:
        limit = self.config.max_time
        return limit is not None and time.monotonic() - self._started_at >= limit

    def _should_interrupt(self) -> bool:
        return self._stop.is_set() or self._time_exhausted()

    # ---- one round -------------------------------------------------------------------------

    def run_round(self) -> MergeResult | None:
        """H inner steps from the newest replica, then publish the pseudo-gradient.

        With fragments, fragment p is published during the round (see node.streaming); the
        result returned is the last fragment's.
        """
        start = time.perf_counter()
        begun = self._begin_round()
        base, base_applied = begun.base, begun.base_applied
        self._round_published = []
        self._round_steps = self._planned_steps()
        stats = self.learner.run_round(
            self._round_steps - begun.steps_done,
            self._should_interrupt,
            self._on_step,
            _remaining(self.config.round_time, begun.inner_s),
        )
        self.round_sizer.observe_round(stats.num_steps, stats.compute_s)
        done = begun.extended(stats, time.perf_counter() - start)
        if stats.stopped_early or done.steps_done == 0:
            if self._stream is not None:
                # Streaming: the fragments due so far are published; the others' steps since
                # their last publication are dropped, and the next round starts afresh.
                self._stream = self._partial = None
                return None
            # Interrupted: not published; kept (and checkpointed) to be finished later.
            params = self.learner.params_vector()
            self._partial = replace(done, params=params) if done.steps_done else None
            return None
        self._partial = None
        stats = done.as_round_stats()
        t_inner = time.perf_counter()
        # Fragments published during the inner steps: their time is overhead, not steps.
        in_steps_s = sum(p.encode_s + p.seal_s + p.merge_s for p in self._round_published)
        if self._stream is not None:
            for fragment in self._stream.unpublished(stats.num_steps):  # cut by --round-time
                self._publish_fragment(self._stream, fragment, stats.num_steps)
        else:
            pseudo_gradient = base - self.learner.params_vector()
            self._round_published.append(
                self._publish(
                    pseudo_gradient,
                    self.compressor.encode,
                    base_applied,
                    stats.num_steps,
                    stats.tokens,
                    stats.loss,
                )
            )
        published = self._round_published
        self.round += 1
        t_merge = time.perf_counter()
        val_loss = self._evaluate_replica()
        t_eval = time.perf_counter()
        encode_s = sum(p.encode_s for p in published)
        seal_s = sum(p.seal_s for p in published)
        merge_s = sum(p.merge_s for p in published)
        timings = RoundTimings(
            inner_s=t_inner - start + begun.inner_s - in_steps_s,
            encode_s=encode_s,
            seal_s=seal_s,
            merge_s=merge_s,
            eval_s=t_eval - t_merge,
        )
        accepted = any(p.result.accepted for p in published)
        round_s = t_eval - start + begun.inner_s
        update_bytes = sum(p.update_bytes for p in published)
        seq = self.seq if accepted else None
        self._report_round(stats, val_loss, timings, round_s, seq, begun.steps_done, update_bytes)
        self.stats.finish_round(stats.loss, val_loss, stats.tokens / max(round_s, 1e-9))
        return published[-1].result if published else None

    def _publish(
        self,
        pseudo_gradient: torch.Tensor,
        encode: Callable[[torch.Tensor], bytes],
        base_applied: int,
        steps: int,
        tokens: int,
        loss: float,
        fragment: int | None = None,
    ) -> _Published:
        """Encodes, seals and merges one of our updates, then gives it to the swarm."""
        t_start = time.perf_counter()
        payload = encode(pseudo_gradient)
        t_encode = time.perf_counter()
        # On disk before it is sealed: a restart never signs another payload under this seq.
        self.seq_ledger.record(self.seq + 1)
        update = seal(
            self.identity,
            fingerprint=self.fingerprint,
            seq=self.seq + 1,
            base_applied=base_applied,
            published_applied=self.replica.num_applied,
            inner_steps=steps,
            tokens=tokens,
            loss=loss,
            codec=self.codec.name,
            numel=pseudo_gradient.numel(),
            payload=payload,
            learners=self.live_learners(),
            fragment=fragment,
            fragments=None if fragment is None else self.replica.num_fragments,
        )
        t_seal = time.perf_counter()
        result = self.pipeline.submit(update)
        t_merge = time.perf_counter()
        self.report_merge(result)
        if result.accepted:  # a rejected own update is not published and gives up no seq
            self._delay = expected_delay(update.header.staleness, result.learners)
            self.seq += 1
            if self.swarm is not None:
                self.swarm.publish(update)
                self.published_seq = self.seq
        update_bytes = len(update.to_bytes()) if result.accepted else 0
        return _Published(
            result, update_bytes, t_encode - t_start, t_seal - t_encode, t_merge - t_seal
        )

    def _on_step(self, step: StepStats) -> None:
        self._report_step(step)
        stream = self._stream
        if stream is None:
            return
        stream.record_step(step.tokens, step.loss)
        at = step.step + self._step_offset
        for fragment in stream.due(at):
            self._publish_fragment(stream, fragment, at)

    def _publish_fragment(self, stream: FragmentStream, fragment: int, step: int) -> None:
        """Publishes the fragment's pseudo-gradient, then the learner adopts the merged
        fragment (ours and the peers' merged so far): its next round starts from there."""
        layout, compressors = self.replica.layout, self.fragment_compressors
        assert layout is not None and compressors is not None
        r = stream.rounds[fragment]
        if r.steps == 0:
            return
        inner = self.learner.params_vector()
        published = self._publish(
            stream.pseudo_gradient(fragment, inner),
            lambda g: compressors.encode(fragment, g),
            r.base_applied, r.steps, r.tokens, r.loss, fragment,
        )  # fmt: skip
        self._round_published.append(published)
        merged, applied = self.replica.fragment_params(fragment)
        layout.scatter(inner, fragment, merged)
        self.learner.load_params(inner)
        stream.adopt(fragment, merged, applied)
        self.events.emit(
            "fragment_published",
            round=self.round + 1,
            step=step,
            fragment=fragment,
            seq=self.seq if published.result.accepted else None,
            update_bytes=published.update_bytes,
        )

    def _begin_round(self) -> RoundProgress:
        """The unfinished round saved at the last stop, else a new one from the replica.

        Streaming fragments: the learner keeps its params from round to round (each fragment
        adopts the replica's at its own publication); only a new stream starts from it.
        """
        layout = self.replica.layout
        if layout is not None:
            self._step_offset = 0
            if self._stream is None:
                base, base_applied = self.replica.snapshot()
                self.learner.load_params(base)
                self._stream = FragmentStream(layout, self.config.inner_steps, base, base_applied)
            return RoundProgress(self._stream.base, self._stream.rounds[0].base_applied)
        partial = self._partial
        if partial is not None and partial.params is not None:
            self.learner.load_params(partial.params)
            self._step_offset = partial.steps_done
            return partial
        base, base_applied = self._round_start()
        self.learner.load_params(base)
        self._step_offset = 0
        return RoundProgress(base, base_applied)

    def _round_start(self) -> tuple[torch.Tensor, int]:
        """The replica and its applied count; with --correction lookahead, moved on along the
        outer momentum by the swarm rounds our last update took to land (merge.correction)."""
        with self.replica.lock:
            params, applied = self.replica.snapshot()
            momentum = self.replica.outer.momentum_buffer
            lr = self.merge_config.outer.lr
            start = look_ahead(self.merge_config.correction, params, momentum, self._delay, lr)
        return start, applied

    def _planned_steps(self) -> int:
        """H, or with --dynamic-h H scaled by this learner's rate over the fastest live peer's."""
        if not self.config.dynamic_h:
            return self.config.inner_steps
        peers = self.swarm.alive_peers() if self.swarm is not None else []
        rates = [PeerRate(h.peer_id, h.steps_per_s) for h in peers if h.state == "training"]
        return self.round_sizer.steps(rates)

    def _evaluate_replica(self) -> float | None:
        if not self.val_batches:
            return None
        # Streaming fragments train on across rounds: their params are put back afterwards.
        inner = self.learner.params_vector() if self._stream is not None else None
        params, _ = self.replica.snapshot()
        self.learner.load_params(params)
        val_loss = round(self.learner.evaluate(self.val_batches), 6)
        if inner is not None:
            self.learner.load_params(inner)
        return val_loss

    # ---- reporting -------------------------------------------------------------------------

    def _report_step(self, step: StepStats) -> None:
        self.events.progress(
            round=self.round + 1,
            step=step.step + self._step_offset,
            inner_steps=self._round_steps,
            loss=step.loss,
            tokens_per_s=step.tokens_per_s,
        )

    def report_merge(self, result: MergeResult) -> None:
        """Called for every update, own or peer's, from whichever thread merged it."""
        if result.accepted:
            self.stats.count_merge(result.staleness)
            if result.author != self.peer_id:
                # A fragment update (1 of P) stands for 1/P of its round's steps.
                steps = result.inner_steps / self.config.fragments
                self.round_sizer.observe_update(result.author, steps, time.monotonic())
            if not self._resketcher.changed():
                self._record_replica()
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
        else:
            self.events.emit(
                "update_rejected", author=result.author, seq=result.seq, reason=result.reason
            )

    def _report_round(
        self,
        stats: RoundStats,
        val_loss: float | None,
        t: RoundTimings,
        round_s: float,
        seq: int | None,
        resumed_at_step: int,
        update_bytes: int,
    ) -> None:
        loss, tokens = stats.loss, stats.tokens
        bytes_sent, bytes_received = WIRE_BYTES.totals()
        self.events.emit(
            "round_done",
            round=self.round,
            seq=seq,
            steps=stats.num_steps,
            planned_steps=self._round_steps,
            steps_per_s=_rounded(self.round_sizer.own_rate),
            resumed_at_step=resumed_at_step,
            learner_step=self.learner.step,
            loss=round(loss, 6),
            val_loss=val_loss,
            tokens=tokens,
            tokens_per_s=round(tokens / max(round_s, 1e-9), 1),
            num_applied=self.replica.num_applied,
            round_s=round(round_s, 4),
            inner_s=round(t.inner_s, 4),
            encode_s=round(t.encode_s, 5),
            seal_s=round(t.seal_s, 5),
            merge_s=round(t.merge_s, 5),
            eval_s=round(t.eval_s, 4),
            drift=self.drift(),
            peers_alive=len(self.swarm.alive_peers()) if self.swarm is not None else 0,
            lost=self.swarm.num_lost if self.swarm is not None else 0,
            codec=self.codec.name,
            update_bytes=update_bytes,
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
        )

    def live_learners(self) -> int:
        """This node and its alive peers that learn (dht.membership.count_learners): the M
        its update is sized by."""
        if self.swarm is None:
            return 1
        alive = self.swarm.alive_peers()
        live = 1 + count_learners(alive, lambda peer_id: self.replica.last_seq(peer_id) >= 1)
        # Peers whose updates are among the last few applied here learn, whether or not the
        # last membership read found them: ~1,000 Sybil heartbeats make reads miss live peers,
        # and a node that sized its updates as a lone learner then took whole outer steps.
        idle = {h.peer_id for h in alive if h.state == "idle"}
        with self.replica.lock:
            recent = self.pipeline.learner_floor.recent_authors(max(8, 2 * live))
        return max(live, 1 + len(recent - idle - {self.peer_id}))

    # ---- what the swarm sees -----------------------------------------------------------------

    def _record_replica(self) -> None:
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
        if self.swarm is None:
            return None
        return self.stats.drift(self.swarm.alive_peers())

    @property
    def _rejection_log(self) -> RejectionLog:
        return self.pipeline.rejection_log

    def heartbeat(self) -> Heartbeat:
        """Built from figures kept up to date elsewhere: cheap enough for the swarm's loop."""
        s = self.stats.snapshot()
        merged = self.pipeline.num_merged
        rejections = dict(self.pipeline.rejections)
        if self.swarm is not None:
            for reason, count in list(self.swarm.rejections.items()):
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
            loss=_reportable_loss(s.last_round.loss),
            val_loss=_reportable_loss(s.last_round.val_loss),
            num_applied=s.replica.num_applied,
            applied_digest=s.replica.applied_digest,
            latest_seq=s.published_seq,
            updates_published=s.published_seq,
            updates_merged=merged,
            staleness_mean=round(s.staleness_sum / max(merged, 1), 4),
            drift=self.drift(),
            sketch=list(s.replica.sketch),
            uptime_s=round(time.monotonic() - self._started_at, 1),
            maddrs=self.swarm.visible_maddrs if self.swarm is not None else [],
            serves_state=self.config.serve_state,
            rejections=rejections,
            sent_at=time.time(),
            merged_by_author=dict(s.replica.merged_by_author),
            staleness_histogram=list(s.staleness_counts),
            heartbeat_period_s=self.config.heartbeat_period,
            num_lost=self.swarm.num_lost if self.swarm is not None else 0,
            rejected_peers=self.pipeline.rejection_log.top(
                MAX_REJECTED_PEERS, MAX_REJECTED_REASONS
            ),
            bytes_sent=bytes_sent,
            bytes_received=bytes_received,
        )

    def status(self) -> NodeStatus:
        """One read-only picture of the node and the peers it sees (for the dashboard)."""
        own = self.heartbeat()
        now = time.time()
        peers: tuple[PeerSighting, ...] = ()
        fetches: list[Any] = []
        if self.swarm is not None:
            period, at = self.swarm.config.heartbeat_period_s, self.swarm.membership.judged_at()
            peers = tuple(
                PeerSighting(view.heartbeat, view.alive(period, at), now - view.last_seen)
                for view in list(self.swarm.peers.values())
            )
            fetches = list(self.swarm.fetches)
        return NodeStatus(
            run_id=self.config.run_id,
            fingerprint=self.fingerprint,
            own=own,
            peers=peers,
            fetches=len(fetches),
            fetched_bytes=sum(f.num_bytes for f in fetches),
            taken_at=now,
        )

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        partial = self._partial
        with self.replica.lock:  # the replica and what judged its updates, at one moment
            replica = self.replica.state_dict()
            merge = self.pipeline.state_dict()
            equivocation = self.pipeline.equivocation.state_dict()
        return {
            "fingerprint": self.fingerprint,
            "model": {"name": self.config.model, "vocab_size": self.spec.model.vocab_size},
            "peer_id": self.peer_id,
            "round": self.round,
            "seq": self.seq,
            "replica": replica,
            "learner": self.learner.state_dict(),
            "partial_round": partial.state_dict() if partial is not None else None,
            "error_feedback": self._error_feedback().state_dict(),
            "equivocation": equivocation,
            "merge": merge,
        }

    def _error_feedback(self) -> Compressor | FragmentCompressors:
        return self.compressor if self.fragment_compressors is None else self.fragment_compressors

    def param_layout(self) -> Layout:
        """The model's parameters in the replica's flat order (names for the weights file)."""
        return [(name, p.shape) for name, p in self.learner.model.named_parameters()]

    def save_checkpoint(self) -> None:
        path = save_checkpoint(self.checkpoint_dir, self.state_dict(), self.param_layout())
        if self.swarm is not None:  # known-peers hook: tried on restart (dht/known_peers.py)
            remember_peers(self.checkpoint_dir, self.swarm.alive_peers())
        step = self._partial.steps_done if self._partial is not None else 0
        self.events.emit("checkpoint_saved", path=str(path), round=self.round, step=step)

    def _resume(self) -> None:
        path = self.checkpoint_dir
        state = load_checkpoint(path, self.fingerprint, self.param_layout())
        if state is None:
            return
        try:
            self.replica.load_state_dict(state["replica"])
            self.learner.load_state_dict(state["learner"])
            if "error_feedback" in state:  # checkpoints before codecs with error feedback lack it
                self._error_feedback().load_state_dict(state["error_feedback"])
            # Proven equivocations and the ids settled in this replica (merge.equivocation).
            self.pipeline.equivocation.load_state_dict(state.get("equivocation"), self.fingerprint)
            # The robust windows and the learner floor (checkpoints before them lack "merge").
            self.pipeline.load_state_dict(state.get("merge"))
            self.round = int(state["round"])
            own_seq = int(state["seq"]) if state["peer_id"] == self.peer_id else 0
            partial = state.get("partial_round")
            if partial is not None:
                inner_steps = self.config.inner_steps
                self._partial = RoundProgress.from_state_dict(partial, self.num_params, inner_steps)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint in {path} is damaged ({exc})") from None
        # A node that rejoins with the same identity continues its seq numbers.
        self.seq = max(own_seq, self.replica.last_seq(self.peer_id), self.seq_ledger.last(), 0)
        self._record_replica()
        self.events.emit(
            "resumed",
            path=str(self.checkpoint_dir),
            round=self.round,
            step=self._partial.steps_done if self._partial is not None else 0,
            num_applied=self.replica.num_applied,
        )


def peers_finished(
    peers: list[Heartbeat], last_seq: Callable[[str], int], own_id: str, own_updates: int
) -> bool:
    """Whether every peer has stopped training (idle), its last update is applied here and,
    by its heartbeat, our ``own_updates`` updates are applied there."""
    return all(
        h.state == "idle"
        and last_seq(h.peer_id) >= h.latest_seq
        and h.merged_by_author.get(own_id, 0) >= own_updates
        for h in peers
    )


def _remaining(limit_s: float | None, spent_s: float) -> float | None:
    """What is left of a round's time limit after `spent_s` (None: no limit)."""
    return None if limit_s is None else max(limit_s - spent_s, 0.0)


def _rounded(rate: float | None) -> float | None:
    """A rate to six significant digits (None stays None)."""
    return None if rate is None else float(f"{rate:.6g}")


def _reportable_loss(loss: float | None) -> float | None:
    """A diverged loss (inf, nan, huge) is reported as unknown: peers refuse such heartbeats."""
    return loss if loss is not None and math.isfinite(loss) and 0 <= loss <= MAX_LOSS else None
