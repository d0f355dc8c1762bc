"""Publishing this node's pseudo-gradients: whole updates at the end of a round, or a stream
of fragments during it (Streaming DiLoCo, `--fragments P`).

`Publisher` seals one update and hands it to the pipeline and the swarm. A `RoundPublishing`
decides where a round starts and what it publishes: `WholeUpdates` here, or
node.fragment_publishing's `FragmentStreams`.
With `--codec auto` (`AutoCodec`) whole updates pick their codec at each round start from the
uplink this process measured (dht.transport.UPLINK); a stopping node sends its error feedback
residual once, dense (`RoundPublishing.flush`; per fragment with fragments), marked as a flush
(merge.envelope): replicas apply it as a plain step, without outer momentum.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from dht.transport import UPLINK
from merge.codec_base import Codec
from merge.codec_policy import AUTO, CodecChoice, CodecPicker
from merge.codecs import get_codec
from merge.correction import expected_delay, look_ahead
from merge.envelope import seal
from merge.feedback import Compressor
from merge.identity import Identity
from merge.pipeline import MergeConfig, MergeResult, UpdatePipeline
from merge.replica import Replica
from node.learner import Learner, RoundStats, StepStats
from node.progress import RoundProgress
from node.seq_ledger import SeqLedger
from node.stats import NodeStats
from node.streaming import FragmentCompressors
from node.swarm_link import SwarmLink


@dataclass(frozen=True)
class Published:
    """One update this node sealed and submitted (a whole-model one or a fragment)."""

    result: MergeResult
    update_bytes: int
    """Bytes of the signed envelope, 0 when our own pipeline refused it (not published)."""
    encode_s: float
    seal_s: float
    merge_s: float


def publishing_s(published: list[Published]) -> float:
    """The training thread's time in encoding, sealing and merging these publications."""
    return sum(p.encode_s + p.seal_s + p.merge_s for p in published)


class Publisher:
    """Encodes, seals and merges one of our updates, then gives it to the swarm."""

    def __init__(
        self,
        *,
        identity: Identity,
        fingerprint: str,
        codec: Codec,
        replica: Replica,
        pipeline: UpdatePipeline,
        seq_ledger: SeqLedger,
        stats: NodeStats,
        swarm: SwarmLink,
        report_merge: Callable[[MergeResult], None],
    ) -> None:
        self.identity, self.fingerprint, self.codec = identity, fingerprint, codec
        self.replica, self.pipeline, self.seq_ledger = replica, pipeline, seq_ledger
        self.stats, self.swarm, self.report_merge = stats, swarm, report_merge
        self.delay = 0.0
        """Swarm rounds our last update took to land (merge.correction.expected_delay)."""

    def publish(
        self,
        pseudo_gradient: torch.Tensor,
        encode: Callable[[torch.Tensor], bytes],
        base_applied: int,
        work: tuple[int, int, float],
        fragment: int | None = None,
        codec: Codec | None = None,
        flush: bool = False,
    ) -> Published:
        """`work`: the inner steps, tokens and mean loss the pseudo-gradient comes from;
        `codec`: what `encode` encodes with, when not this publisher's; `flush`: the update is
        our residual, sent once as we stop (signed: replicas apply it without momentum)."""
        steps, tokens, loss = work
        t_start = time.perf_counter()
        payload = encode(pseudo_gradient)
        t_encode = time.perf_counter()
        seq = self.stats.seq + 1
        # On disk before it is sealed: a restart never signs another payload under this seq.
        self.seq_ledger.record(seq)
        update = seal(
            self.identity,
            fingerprint=self.fingerprint,
            seq=seq,
            base_applied=base_applied,
            published_applied=max(base_applied, self.replica.progress),  # credited progress
            inner_steps=steps,
            tokens=tokens,
            loss=loss,
            codec=(codec or self.codec).name,
            numel=pseudo_gradient.numel(),
            payload=payload,
            learners=self.swarm.live_learners(),
            fragment=fragment,
            fragments=None if fragment is None else self.replica.num_fragments,
            flush=flush,
        )
        t_seal = time.perf_counter()
        result = self.pipeline.submit(update)
        t_merge = time.perf_counter()
        self.report_merge(result)
        if result.accepted:  # a rejected own update is not published and gives up no seq
            self.delay = expected_delay(update.header.staleness, result.learners)
            self.stats.set_seq(seq)
            if self.swarm.publish(update):
                self.stats.set_published_seq(seq)
        update_bytes = len(update.to_bytes()) if result.accepted else 0
        return Published(
            result, update_bytes, t_encode - t_start, t_seal - t_encode, t_merge - t_seal
        )


class RoundPublishing(Protocol):
    """Where a round starts and what of it is published, and when."""

    published: list[Published]
    """This round's publications so far."""

    def begin(self, partial: RoundProgress | None) -> RoundProgress:
        """Load the learner with the round's start; the progress it resumes from."""

    def on_step(self, step: int, stats: StepStats) -> None:
        """After inner step `step` of the round (counted from its start)."""

    def finish(
        self, base: RoundProgress, stats: RoundStats, params: torch.Tensor | None = None
    ) -> None:
        """The round's inner steps are done: publish what is left of it. `params`: the
        learner's parameters as the round ended, for a round set aside while the next one
        trains (node.trainer; whole updates only); None: the learner's own, now."""

    def interrupted(self, done: RoundProgress) -> RoundProgress | None:
        """The round stopped early: what to keep (and checkpoint) to finish it later."""

    def holds_learner_params(self) -> bool:
        """Whether the learner's params carry over to the next round (evaluation restores them)."""

    def keeps_partial_rounds(self) -> bool:
        """Whether a round stopped midway is kept to be finished (and checkpointed meanwhile)."""

    def error_feedback(self) -> Compressor | FragmentCompressors:
        """What the lossy codecs carry from one payload to the next (checkpointed)."""

    def flush(self) -> Published | None:
        """The node stops: publish what its error feedback still holds, once, dense (bf16),
        marked as a flush (replicas apply it without outer momentum), so its trained progress
        reaches the swarm instead of stopping with it; with fragments one update per fragment,
        reported as one (None: nothing held, or no round published by this process yet, so
        its seq is not known)."""


FLUSH_CODEC = "bf16"
"""What a stopping node sends its residual with: dense (the codec is per update)."""


@dataclass
class AutoCodec:
    """`--codec auto` for whole updates: the picker, where the uplink figure comes from, and
    who is told the choice (the event log, round_done's codec)."""

    picker: CodecPicker
    uplink: Callable[[], float | None]
    """The uplink measured so far in bytes per second (dht.transport.UPLINK.bytes_per_s)."""
    report: Callable[[CodecChoice, float], None]
    """Told each choice and the uplink it was made at."""
    clock: Callable[[], float] = time.monotonic


def auto_codec(
    codec: str, numel: int, report: Callable[[CodecChoice, float], None]
) -> AutoCodec | None:
    """--codec auto's picker, measured by this process's sends; None for a named codec."""
    if codec != AUTO:
        return None
    return AutoCodec(CodecPicker(numel), UPLINK.bytes_per_s, report)


class WholeUpdates:
    """One update per round: base minus the learner's params after its inner steps."""

    def __init__(
        self,
        publisher: Publisher,
        learner: Learner,
        merge: MergeConfig,
        codec: Codec,
        auto: AutoCodec | None = None,
    ) -> None:
        self.publisher, self.learner, self.merge = publisher, learner, merge
        self.replica = publisher.replica
        # Error feedback for the lossy codecs: what a payload drops goes into the next round's.
        self.compressor = Compressor(codec, self.replica.numel)
        self.auto = auto
        self.published: list[Published] = []
        self._last_work: tuple[int, int, float] | None = None
        """The last round this process published: its inner steps, tokens and loss."""

    def begin(self, partial: RoundProgress | None) -> RoundProgress:
        self.published = []
        if partial is not None and partial.params is not None:
            self.learner.load_params(partial.params)
            return partial
        self._pick_codec()
        base, base_applied = self.round_start()
        start = self.compressor.round_start(base)  # minus what we trained but have not sent
        self.learner.load_params(start)
        return RoundProgress(start, base_applied)

    def round_start(self) -> tuple[torch.Tensor, int]:
        """The replica and its applied count; with --correction lookahead, moved on along the
        outer momentum by the swarm rounds our last update took to land (merge.correction)."""
        with self.replica.lock:
            params, applied = self.replica.snapshot()
            momentum = self.replica.outer.momentum_buffer
            lr = self.merge.outer.lr
            delay = self.publisher.delay
            start = look_ahead(self.merge.correction, params, momentum, delay, lr)
        return start, applied

    def _pick_codec(self) -> None:
        """--codec auto: this round's codec, from the uplink measured so far."""
        if self.auto is None:
            return
        uplink = self.auto.uplink()
        learners = self.publisher.swarm.live_learners()
        choice = self.auto.picker.round_start(self.auto.clock(), uplink, learners)
        if choice is None or uplink is None:
            return
        if choice.codec != self.compressor.codec.name:
            self.compressor.switch(get_codec(choice.codec))
        self.auto.report(choice, uplink)

    def on_step(self, step: int, stats: StepStats) -> None:
        """Nothing is published during a round."""

    def finish(
        self, base: RoundProgress, stats: RoundStats, params: torch.Tensor | None = None
    ) -> None:
        end = self.learner.params_vector() if params is None else params
        pseudo_gradient = base.base - end
        work = (stats.num_steps, stats.tokens, stats.loss)
        codec = self.compressor.codec
        self.published.append(
            self.publisher.publish(
                pseudo_gradient, self.compressor.encode, base.base_applied, work, codec=codec
            )
        )
        self._last_work = work

    def flush(self) -> Published | None:
        """The residual as one bf16 update, weighed like the last round this process
        published (its steps and tokens: the residual is mostly that round's unsent part),
        based on the replica as it is now."""
        if self._last_work is None or not self.compressor.pending():
            return None
        codec = get_codec(FLUSH_CODEC)
        residual, payload = self.compressor.flush(codec)
        published = self.publisher.publish(
            residual,
            lambda _: payload,
            self.replica.progress,
            self._last_work,
            codec=codec,
            flush=True,
        )
        self.published.append(published)
        return published

    def interrupted(self, done: RoundProgress) -> RoundProgress | None:
        """Not published; kept (and checkpointed) to be finished later."""
        params = self.learner.params_vector()
        return replace(done, params=params) if done.steps_done else None

    def holds_learner_params(self) -> bool:
        return False

    def keeps_partial_rounds(self) -> bool:
        return True

    def error_feedback(self) -> Compressor:
        return self.compressor
