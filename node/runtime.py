"""A node: wires the learner, the replica and the update pipeline together and runs rounds."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

import psutil
import torch
from torch.nn.utils import parameters_to_vector

from dht.addresses import join_hint, listen_maddrs
from dht.heartbeat import MAX_AUTHORS, STALENESS_BUCKETS, Heartbeat, staleness_bucket
from dht.swarm import Swarm, SwarmConfig
from merge.codecs import get_codec
from merge.correction import CorrectionConfig
from merge.envelope import seal
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, MergeResult, UpdatePipeline
from merge.replica import Replica
from merge.sketch import ReplicaSketch, relative_distance
from merge.weighting import StalenessConfig, TokenWeightConfig
from node.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from node.config import JoinConfig, run_fingerprint
from node.data import ShardSampler, load_corpus, split_corpus, validation_batches
from node.events import EventLog
from node.learner import InnerConfig, Learner, StepStats, resolve_device
from node.model import DEFAULT_BATCH_SIZE, DEFAULT_INNER_LR, build_model, model_config

if TYPE_CHECKING:
    from dashboard.embedded import EmbeddedDashboard

logger = logging.getLogger(__name__)


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


def merge_config_from(config: JoinConfig, tokens_per_step: int) -> MergeConfig:
    return MergeConfig(
        outer=OuterConfig(
            kind=config.outer_optimizer,  # type: ignore[arg-type]
            lr=config.outer_lr,
            momentum=config.outer_momentum,
            delay=config.outer_delay,
        ),
        staleness=StalenessConfig(
            kind=config.staleness,  # type: ignore[arg-type]
            a=config.staleness_a,
            b=config.staleness_b,
        ),
        token_weight=TokenWeightConfig(
            kind=config.token_weighting,  # type: ignore[arg-type]
            reference_tokens=config.inner_steps * tokens_per_step,
        ),
        max_inner_steps=config.inner_steps,
        max_tokens_per_step=tokens_per_step,
        correction=CorrectionConfig(kind=config.correction),  # type: ignore[arg-type]
    )


class Node:
    """One learner with its replica of the global model."""

    def __init__(self, config: JoinConfig, events: EventLog) -> None:
        self.config = config
        self.events = events
        self.identity, _ = Identity.load_or_create(config.identity_path)
        self.peer_id = self.identity.peer_id
        self.device = resolve_device(config.device)
        if config.threads:
            torch.set_num_threads(config.threads)
        self.corpus = load_corpus(config.data)
        split = split_corpus(self.corpus)
        self.model_config = model_config(config.model, self.corpus.vocab_size)
        batch_size = config.batch_size or DEFAULT_BATCH_SIZE[config.model]
        tokens_per_step = batch_size * self.model_config.block_size
        self.merge_config = merge_config_from(config, tokens_per_step)
        self.fingerprint = run_fingerprint(
            {
                "run_id": config.run_id,
                "seed": config.seed,
                "model": self.model_config.as_dict(),
                "merge": self.merge_config.as_dict(),
            }
        )
        model = build_model(self.model_config, config.seed)
        genesis = parameters_to_vector(model.parameters()).detach().float().clone()
        outer = make_outer_optimizer(self.merge_config.outer, genesis.numel())
        self.replica = Replica(genesis, outer)
        self.pipeline = UpdatePipeline(self.replica, self.merge_config, self.fingerprint)
        self.codec = get_codec(config.codec)
        self.num_params = genesis.numel()
        sampler = ShardSampler(
            split.train,
            seed=f"{config.run_id}/{self.peer_id}",
            batch_size=batch_size,
            block_size=self.model_config.block_size,
        )
        max_steps = (config.max_rounds or 0) * config.inner_steps
        inner = InnerConfig(
            lr=config.inner_lr or DEFAULT_INNER_LR[config.model],
            weight_decay=config.weight_decay,
            grad_clip=config.grad_clip,
            warmup_steps=config.warmup_steps,
            decay_steps=config.lr_decay_steps or max_steps or 100_000,
            speed_factor=config.speed_factor,
            emulated_step_s=config.emulated_step_s,
        )
        self.learner = Learner(model, sampler, inner, self.device)
        self.val_batches = (
            validation_batches(
                split.val,
                batch_size=batch_size,
                block_size=self.model_config.block_size,
                num_batches=config.eval_batches,
            )
            if config.eval_batches
            else []
        )
        self.round = 0
        self.seq = 0
        self.published_seq = 0
        self.state = "syncing"
        self.last_round: dict[str, Any] = {"loss": None, "val_loss": None, "tokens_per_s": 0.0}
        self._staleness_sum = 0
        self._staleness_counts = [0] * len(STALENESS_BUCKETS)
        self._merged_by_author: tuple[int, dict[str, int]] = (-1, {})
        self.sketcher = ReplicaSketch(self.num_params, self.fingerprint)
        self._sketches: OrderedDict[str, list[float]] = OrderedDict()
        self._stop = threading.Event()
        self._started_at = time.monotonic()
        self.dashboard: EmbeddedDashboard | None = None
        if config.dashboard_port is not None:
            # The dashboard sits above node/: imported only when asked for.
            from dashboard.embedded import EmbeddedDashboard

            self.dashboard = EmbeddedDashboard(self)
            self.events = self.dashboard.tee(events)
        self.swarm = self._make_swarm() if config.swarm else None

    def _make_swarm(self) -> Swarm:
        c = self.config
        summary = {"model": c.model, **self.model_config.as_dict(), "seed": c.seed}
        summary |= {"inner_steps": c.inner_steps, "outer": c.outer_optimizer}
        swarm_config = SwarmConfig(
            run_id=c.run_id,
            fingerprint=self.fingerprint,
            run_summary=summary,
            identity_path=str(c.identity_path),
            initial_peers=list(c.peers or []),
            host_maddrs=listen_maddrs(c.host, c.port),
            announce_maddrs=list(c.announce or []),
            use_relay=c.relay,
            use_auto_relay=c.auto_relay,
            client_mode=c.client_mode,
            serve_state=c.serve_state,
            heartbeat_period_s=c.heartbeat_period,
            retain_updates=c.retain_updates,
            gap_wait_s=c.gap_wait,
            retain_bytes=int(c.retain_mb * 1e6),
            max_update_bytes=4 * self.num_params + (1 << 16),
            max_state_bytes=16 * self.num_params + (64 << 20),
        )
        return Swarm(
            swarm_config,
            self.identity,
            self.replica,
            self.pipeline,
            heartbeat_fn=self.heartbeat,
            on_merge=self.report_merge,
            on_event=self.events.emit,
        )

    # ---- lifecycle -------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
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
                self.swarm.shutdown()

    def _start_dashboard(self) -> None:
        """Once the swarm's DHT process has forked: no server thread may hold a lock then."""
        if self.dashboard is None:
            return
        url = self.dashboard.start()
        logger.info("dashboard at %s", url)
        self.events.emit("dashboard", url=url)

    def join_swarm(self) -> None:
        assert self.swarm is not None
        maddrs = self.swarm.start()
        extra = ["--run-id", self.config.run_id, "--model", self.config.model]
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
            )
        # A node that rejoins with the same identity continues its seq numbers.
        self.seq = max(self.seq, self.replica.last_seq(self.peer_id), self.swarm.announced_seq())
        self.published_seq = self.seq
        self._record_sketch()
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
        """Keep serving and merging for --linger seconds, so peers still get our last update."""
        if self.swarm is None or not self.config.linger:
            return
        self.state = "idle"
        self.events.emit("lingering", seconds=self.config.linger)
        self._stop.wait(self.config.linger)

    def _rounds_exhausted(self) -> bool:
        return self.config.max_rounds is not None and self.round >= self.config.max_rounds

    def _time_exhausted(self) -> bool:
        limit = self.config.max_time
        return limit is not None and time.monotonic() - self._started_at >= limit

    def _should_interrupt(self) -> bool:
        return self._stop.is_set() or self._time_exhausted()

    # ---- one round -------------------------------------------------------------------------

    def run_round(self) -> MergeResult | None:
        """H inner steps from the newest replica, then publish the pseudo-gradient."""
        start = time.perf_counter()
        base, base_applied = self.replica.snapshot()
        self.learner.load_params(base)
        stats = self.learner.run_round(
            self.config.inner_steps, self._should_interrupt, self._report_step,
            self.config.round_time,
        )  # fmt: skip
        if stats.stopped_early or stats.num_steps == 0:
            return None  # interrupted: a partial round is not published
        t_inner = time.perf_counter()
        pseudo_gradient = base - self.learner.params_vector()
        payload = self.codec.encode(pseudo_gradient)
        t_encode = time.perf_counter()
        update = seal(
            self.identity,
            fingerprint=self.fingerprint,
            seq=self.seq + 1,
            base_applied=base_applied,
            published_applied=self.replica.num_applied,
            inner_steps=stats.num_steps,
            tokens=stats.tokens,
            loss=stats.loss,
            codec=self.codec.name,
            numel=pseudo_gradient.numel(),
            payload=payload,
            learners=self.live_learners(),
        )
        t_seal = time.perf_counter()
        result = self.pipeline.submit(update)
        t_merge = time.perf_counter()
        self.report_merge(result)
        if result.accepted:  # a rejected own update is not published and gives up no seq
            self.seq += 1
            if self.swarm is not None:
                self.swarm.publish(update)
                self.published_seq = self.seq
        self.round += 1
        val_loss = self._evaluate_replica()
        t_eval = time.perf_counter()
        timings = RoundTimings(
            inner_s=t_inner - start,
            encode_s=t_encode - t_inner,
            seal_s=t_seal - t_encode,
            merge_s=t_merge - t_seal,
            eval_s=t_eval - t_merge,
        )
        published = self.seq if result.accepted else None
        self._report_round(stats.loss, stats.tokens, val_loss, timings, t_eval - start, published)
        self.last_round = {
            "loss": stats.loss,
            "val_loss": val_loss,
            "tokens_per_s": stats.tokens / max(t_eval - start, 1e-9),
        }
        return result

    def _evaluate_replica(self) -> float | None:
        if not self.val_batches:
            return None
        params, _ = self.replica.snapshot()
        self.learner.load_params(params)
        return round(self.learner.evaluate(self.val_batches), 6)

    # ---- reporting -------------------------------------------------------------------------

    def _report_step(self, step: StepStats) -> None:
        self.events.progress(
            round=self.round + 1,
            step=step.step,
            inner_steps=self.config.inner_steps,
            loss=step.loss,
            tokens_per_s=step.tokens_per_s,
        )

    def report_merge(self, result: MergeResult) -> None:
        """Called for every update, own or peer's, from whichever thread merged it."""
        if result.accepted:
            self._staleness_sum += result.staleness
            self._staleness_counts[staleness_bucket(max(0, result.staleness))] += 1
            self._record_sketch()
            self.events.emit(
                "update_merged",
                author=result.author,
                seq=result.seq,
                staleness=result.staleness,
                weight=round(result.weight, 6),
                learners=result.learners,
                blocks_corrected=result.blocks_corrected,
                num_applied=self.replica.num_applied,
            )
        else:
            self.events.emit(
                "update_rejected", author=result.author, seq=result.seq, reason=result.reason
            )

    def _report_round(
        self,
        loss: float,
        tokens: int,
        val_loss: float | None,
        t: RoundTimings,
        round_s: float,
        seq: int | None,
    ) -> None:
        self.events.emit(
            "round_done",
            round=self.round,
            seq=seq,
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
        )

    def live_learners(self) -> int:
        """This node and its alive peers that are not idle: the M its update is sized by."""
        if self.swarm is None:
            return 1
        return 1 + sum(h.state != "idle" for h in self.swarm.alive_peers())

    # ---- what the swarm sees -----------------------------------------------------------------

    def _record_sketch(self) -> None:
        with self.replica.lock:
            digest = self.replica.applied_digest()
            self._sketches[digest] = self.sketcher(self.replica.params)
        while len(self._sketches) > 256:
            self._sketches.popitem(last=False)

    def drift(self) -> float | None:
        """Largest relative distance to a live peer's replica holding the same applied set."""
        if self.swarm is None:
            return None
        distances = [
            relative_distance(h.sketch, self._sketches[h.applied_digest])
            for h in self.swarm.alive_peers()
            if h.applied_digest in self._sketches
        ]
        known = [d for d in distances if d is not None]
        return round(max(known), 6) if known else None

    def heartbeat(self) -> Heartbeat:
        with self.replica.lock:
            digest = self.replica.applied_digest()
            sketch = self.sketcher(self.replica.params)
            num_applied = self.replica.num_applied
        merged = self.pipeline.num_merged
        rejections = dict(self.pipeline.rejections)
        if self.swarm is not None:
            for reason, count in self.swarm.rejections.items():
                rejections[reason] = rejections.get(reason, 0) + count
        return Heartbeat(
            peer_id=self.peer_id,
            org=self.config.org,
            version=_package_version(),
            device=str(self.device),
            memory_gb=round(_device_memory_gb(self.device), 1),
            state=self.state,
            round=self.round,
            tokens_per_s=round(float(self.last_round["tokens_per_s"]), 1),
            loss=self.last_round["loss"],
            val_loss=self.last_round["val_loss"],
            num_applied=num_applied,
            applied_digest=digest,
            latest_seq=self.published_seq,
            updates_published=self.published_seq,
            updates_merged=merged,
            staleness_mean=round(self._staleness_sum / max(merged, 1), 4),
            drift=self.drift(),
            sketch=sketch,
            uptime_s=round(time.monotonic() - self._started_at, 1),
            maddrs=self.swarm.visible_maddrs if self.swarm is not None else [],
            serves_state=self.config.serve_state,
            rejections=rejections,
            sent_at=time.time(),
            merged_by_author=self._merged_counts(num_applied),
            staleness_histogram=list(self._staleness_counts),
            heartbeat_period_s=self.config.heartbeat_period,
            num_lost=self.swarm.num_lost if self.swarm is not None else 0,
        )

    def _merged_counts(self, num_applied: int) -> dict[str, int]:
        """Updates per author in the applied set (the authors with most first), for goodput."""
        cached_at, counts = self._merged_by_author
        if cached_at != num_applied:
            applied = self.replica.applied
            top = sorted(applied, key=lambda author: len(applied[author]), reverse=True)
            counts = {author: len(applied[author]) for author in top[:MAX_AUTHORS]}
            self._merged_by_author = (num_applied, counts)
        return counts

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "peer_id": self.peer_id,
            "round": self.round,
            "seq": self.seq,
            "replica": self.replica.state_dict(),
            "learner": self.learner.state_dict(),
        }

    def save_checkpoint(self) -> None:
        path = save_checkpoint(self.config.checkpoint_path, self.state_dict())
        self.events.emit("checkpoint_saved", path=str(path), round=self.round)

    def _resume(self) -> None:
        path = self.config.checkpoint_path
        state = load_checkpoint(path, self.fingerprint)
        if state is None:
            return
        try:
            self.replica.load_state_dict(state["replica"])
            self.learner.load_state_dict(state["learner"])
            self.round = int(state["round"])
            own_seq = int(state["seq"]) if state["peer_id"] == self.peer_id else 0
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint in {path} is damaged ({exc})") from None
        # A node that rejoins with the same identity continues its seq numbers.
        self.seq = max(own_seq, self.replica.last_seq(self.peer_id), 0)
        self.events.emit(
            "resumed",
            path=str(self.config.checkpoint_path),
            round=self.round,
            num_applied=self.replica.num_applied,
        )


def _package_version() -> str:
    try:
        return version("diloco-node")
    except PackageNotFoundError:
        return "0+unknown"


def _device_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / 2**30
    return psutil.virtual_memory().total / 2**30
