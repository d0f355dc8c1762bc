"""A node: wires the learner, the replica and the update pipeline together and runs rounds."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector

from merge.codecs import get_codec
from merge.envelope import seal
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, MergeResult, UpdatePipeline
from merge.replica import Replica
from merge.weighting import StalenessConfig, TokenWeightConfig
from node.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from node.config import JoinConfig, run_fingerprint
from node.data import ShardSampler, load_corpus, split_corpus, validation_batches
from node.events import EventLog
from node.learner import InnerConfig, Learner, StepStats, resolve_device
from node.model import DEFAULT_BATCH_SIZE, DEFAULT_INNER_LR, build_model, model_config

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
        self._stop = threading.Event()
        self._started_at = time.monotonic()

    # ---- lifecycle -------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        self._resume()
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
            self.run_round()
            if self.round % self.config.checkpoint_every == 0:
                self.save_checkpoint()
        self.save_checkpoint()
        self.events.emit("stopped", round=self.round, reason=reason, seq=self.seq)

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
            self.config.inner_steps, self._should_interrupt, self._report_step
        )
        if stats.num_steps < self.config.inner_steps:
            return None  # interrupted: a partial round is not published
        t_inner = time.perf_counter()
        pseudo_gradient = base - self.learner.params_vector()
        payload = self.codec.encode(pseudo_gradient)
        t_encode = time.perf_counter()
        self.seq += 1
        update = seal(
            self.identity,
            fingerprint=self.fingerprint,
            seq=self.seq,
            base_applied=base_applied,
            published_applied=self.replica.num_applied,
            inner_steps=stats.num_steps,
            tokens=stats.tokens,
            loss=stats.loss,
            codec=self.codec.name,
            numel=pseudo_gradient.numel(),
            payload=payload,
        )
        t_seal = time.perf_counter()
        result = self.pipeline.submit(update)
        t_merge = time.perf_counter()
        self.report_merge(result)
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
        self._report_round(stats.loss, stats.tokens, val_loss, timings, t_eval - start)
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
        if result.accepted:
            self.events.emit(
                "update_merged",
                author=result.author,
                seq=result.seq,
                staleness=result.staleness,
                weight=round(result.weight, 6),
                num_applied=self.replica.num_applied,
            )
        else:
            self.events.emit(
                "update_rejected", author=result.author, seq=result.seq, reason=result.reason
            )

    def _report_round(
        self, loss: float, tokens: int, val_loss: float | None, t: RoundTimings, round_s: float
    ) -> None:
        self.events.emit(
            "round_done",
            round=self.round,
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
        )

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
