"""The DiLoCo loop: begin a round from the replica, run H inner steps, publish the
pseudo-gradient, report; until a limit or a stop request. Evaluation runs beside it (on a
snapshot, in a thread), and so does whatever can wait until the first inner step is in
(`Trainer.beside_training`: the state check and gossip, the dashboard).

The Trainer runs with any swarm, the network's or none (node.swarm_link.OfflineSwarm), so
benchmarks run the node's own round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from merge.pipeline import MergeResult
from merge.replica import Replica
from node.config import JoinConfig
from node.evaluation import EVALUATION_WAIT_S, BackgroundEvaluation, EvaluationSchedule, LatestLoss
from node.learner import Learner, RoundStats, StepStats
from node.persistence import Persistence
from node.progress import (
    FinishedRound,
    RoundClock,
    RoundProgress,
    Segment,
    remaining_s,
    round_end,
)
from node.publishing import Published, RoundPublishing, publishing_s
from node.round_size import PeerRate, RoundSizer
from node.stats import NodeStats
from node.swarm_link import SwarmLink
from node.telemetry import RoundReport, RoundTimings, Telemetry


class Trainer:
    """One learner training against its replica of the global model."""

    def __init__(
        self,
        *,
        config: JoinConfig,
        learner: Learner,
        replica: Replica,
        val_batches: list[tuple[torch.Tensor, torch.Tensor]],
        evaluation: BackgroundEvaluation | None,
        publishing: RoundPublishing,
        persistence: Persistence,
        telemetry: Telemetry,
        swarm: SwarmLink,
        round_sizer: RoundSizer,
        stats: NodeStats,
    ) -> None:
        self.config, self.learner, self.replica, self.stats = config, learner, replica, stats
        self.val_batches, self.publishing, self.persistence = val_batches, publishing, persistence
        self.telemetry, self.swarm, self.round_sizer = telemetry, swarm, round_sizer
        self.stop = threading.Event()
        self.finish = threading.Event()
        """Set: no round starts any more, as at --max-rounds (SIGUSR1, node.signals)."""
        self.started_at = time.monotonic()
        self.partial: RoundProgress | None = None
        """The round stopped midway, to be finished (and checkpointed meanwhile)."""
        self.planned_steps = config.inner_steps
        self._step_offset = 0
        self._stepped = False
        self._segment: Segment | None = None
        self._aside: FinishedRound | None = None
        """A finished round waiting for the swarm while the next one trains (`run_round`)."""
        self._late_publish_s = 0.0
        """Of this round's inner steps' wall time, what publishing the round set aside took."""
        self._saved_at = time.monotonic()
        self.schedule = EvaluationSchedule(config.eval_every)
        self.latest_loss = LatestLoss()
        self._evaluation = evaluation
        """Evaluations beside training (None: inline, node.builders.build_evaluation)."""
        self._running = False
        """Inside `run`: evaluations go beside training."""
        self.beside_training: list[Callable[[], None]] = []
        """Started once the first inner step is in (or when no round runs): each starts
        something that runs beside training and returns at once."""

    def run(self) -> None:
        self._running = True
        self.stats.set_state("training")
        self.telemetry.started(self.stats.round, val_loss=None)
        if self._evaluation is None:  # a sharded learner evaluates with its ranks, inline
            self.report_evaluation(self.stats.round, self.evaluate())
        else:  # the replica as it is now, evaluated once the first step is in
            at_start = (self.stats.round, self.replica.snapshot()[0])
            self.beside_training.insert(0, lambda: self._submit_evaluation(*at_start))
        try:
            reason = self._run_rounds()
            self._flush()
            if reason != "interrupted":  # (if no step ran) lingering merges: catch up first
                self._start_beside_training()
                self.swarm.linger(self.config.linger, self.config.linger_until_done, self.stop)
            self.persistence.save(self.partial)
        finally:
            if self._evaluation is not None:
                self._evaluation.wait(EVALUATION_WAIT_S)
        self.telemetry.stopped(reason)

    def _flush(self) -> None:
        """The node stops: what its error feedback still holds goes out once, dense
        (RoundPublishing.flush), before it lingers and saves."""
        flushed = self.publishing.flush()
        if flushed is not None:
            accepted = flushed.result.accepted
            self.telemetry.events.emit(
                "residual_flushed",
                round=self.stats.round,
                seq=self.stats.seq if accepted else None,
                reason=None if accepted else flushed.result.reason,
                update_bytes=flushed.update_bytes,
            )

    def report_evaluation(self, round_: int, val_loss: float | None) -> None:
        """An evaluation of the replica after `round_` finished (the evaluation thread's
        callback, node.app)."""
        if val_loss is not None:
            self.latest_loss.record(round_, val_loss)
        self.telemetry.evaluated(round_, val_loss)

    def _submit_evaluation(self, round_: int, params: torch.Tensor) -> None:
        assert self._evaluation is not None
        self._evaluation.submit(round_, params)

    def _start_beside_training(self) -> None:
        starts, self.beside_training = self.beside_training, []
        for start in starts:
            start()

    def _run_rounds(self) -> str:
        """Rounds until a stop request ("interrupted"), a limit ("max_rounds", "max_time") or a
        finish request ("finished")."""
        while not self.stop.is_set():
            limit = self._limit_reached()
            if limit is not None:
                self._settle_aside()  # a round set aside goes out before the node stops
                return limit
            completed = self.run_round() is not None
            if completed and self.stats.round % self.config.checkpoint_every == 0:
                self.persistence.save_beside(self.partial)  # written beside the next round
        self._settle_aside()
        return "interrupted"

    def run_round(self) -> MergeResult | None:
        """H inner steps from the newest replica, then publish the pseudo-gradient (with
        fragments, fragment p is published during the round; the result is the last one's).

        A round that ends before the swarm is entered and the state checked (a restarted
        node's first rounds) is set aside with its end parameters, and the next round starts
        at once from the replica as it is (one more stale base: its update says so); the
        round set aside is published at the first step boundary after the state check, or
        before this node publishes anything else or stops (node.progress.round_end). None:
        nothing was published by this round (stopped, or set aside)."""
        clock = RoundClock(time.perf_counter())
        begun = self.publishing.begin(self.partial)
        self._step_offset = begun.steps_done
        self._segment = Segment(begun, clock.start)
        self._late_publish_s = 0.0
        self.planned_steps = self._planned_steps()
        stats = self.learner.run_round(
            self.planned_steps - begun.steps_done,
            self._should_interrupt,
            self._on_step,
            remaining_s(self.config.round_time, begun.inner_s),
        )
        self.round_sizer.observe_round(stats.num_steps, stats.compute_s)
        done = begun.extended(stats, time.perf_counter() - clock.start)
        if stats.stopped_early or done.steps_done == 0:
            kept = self.publishing.interrupted(done)
            if self._settle_aside():  # else the round set aside is what is kept
                self.partial = kept
            return None
        clock.inner = time.perf_counter()
        if not self._stepped:  # a finished round resumed to be published: no step ran
            self._start_beside_training()
        end = round_end(
            caught_up=self.swarm.caught_up(),
            aside_waiting=self._aside is not None,
            may_set_aside=self._may_set_aside(),
        )
        if end == "set_aside":
            self.partial = None  # kept aside: the next round starts afresh
            self._set_aside(begun, done, clock)
            return None
        if not self._settle_aside():  # stopped while it waited: it is kept, this round not
            return None
        if not self.swarm.wait_caught_up(self.stop):  # stopped first: published next time
            self.partial = self.publishing.interrupted(done)
            return None
        self.partial = None
        # Fragments and a round set aside, published during the steps: not the steps' time.
        in_steps_s = publishing_s(self.publishing.published) + self._late_publish_s
        ended = FinishedRound(
            begun, done, clock.start, clock.inner, self.planned_steps, self.learner.step
        )
        published = self._publish(ended, in_steps_s)
        return published[-1].result if published else None

    def _may_set_aside(self) -> bool:
        """Whether a round may wait for the swarm beside the next one: only when a next
        round comes (not the last, nor a stopping node's), with whole updates (fragments are
        published during the round), inside `run` (a round run by hand returns its result)."""
        max_rounds = self.config.max_rounds
        return (
            self._running
            and self.publishing.keeps_partial_rounds()
            and (max_rounds is None or self.stats.round + 1 < max_rounds)
            and not (self.stop.is_set() or self.finish.is_set() or self._time_exhausted())
        )

    def _set_aside(self, begun: RoundProgress, done: RoundProgress, clock: RoundClock) -> None:
        """The finished round waits for the swarm with its end parameters while the next one
        trains; saved now (beside training) as a finished round, which a restart publishes:
        the next round is not saved while it waits (the checkpoint holds one round)."""
        params = self.learner.params_vector()
        ended = replace(done, params=params)
        self._aside = FinishedRound(
            begun, ended, clock.start, clock.inner, self.planned_steps, self.learner.step
        )
        self.telemetry.events.emit(
            "round_set_aside", round=self.stats.round + 1, steps=done.steps_done
        )
        self.persistence.save_beside(ended)
        self._saved_at = time.monotonic()

    def _settle_aside(self) -> bool:
        """Before the node publishes another round or stops: the round set aside is published,
        once the swarm is entered (waited for unless the node stops); a node stopped first
        keeps it as its partial round (a restart publishes it), and the running round's steps
        are dropped. True: nothing waits any more."""
        aside = self._aside
        if aside is None:
            return True
        stopping = self.stop.is_set()
        if self.swarm.caught_up() if stopping else self.swarm.wait_caught_up(self.stop):
            self._publish_aside()
            return True
        self._aside, self.partial = None, aside.done
        return False

    def _publish_aside(self) -> None:
        """Publish the round set aside, reported as it ended (`aside_s`: how long it waited)."""
        aside, self._aside = self._aside, None
        assert aside is not None
        self._publish(aside, 0.0, aside_s=time.perf_counter() - aside.ended)

    def _publish(
        self, r: FinishedRound, in_steps_s: float, aside_s: float | None = None
    ) -> list[Published]:
        """Publish round `r`, count it, hand its replica to evaluation and report it; what
        it published. `aside_s`: it was set aside that long, with its end params."""
        late = aside_s is not None
        before = len(self.publishing.published) if late else 0
        stats = r.done.as_round_stats()
        self.publishing.finish(r.begun, stats, r.done.params if late else None)
        published = self.publishing.published[before:]
        if late:  # the round set aside's publications, not the running round's
            del self.publishing.published[before:]
        self.stats.set_round(self.stats.round + 1)
        clock = RoundClock(r.started, r.ended, merged=time.perf_counter())
        self._evaluate_round(self.stats.round)
        clock.evaluated = time.perf_counter()
        val_loss = self.latest_loss.val_loss
        self._report(r, stats, val_loss, clock, in_steps_s, published, aside_s or 0.0)
        return published

    def _report(
        self,
        r: FinishedRound,
        stats: RoundStats,
        val_loss: float | None,
        clock: RoundClock,
        in_steps_s: float,
        published: list[Published],
        aside_s: float,
    ) -> None:
        begun = r.begun
        timings = RoundTimings(
            # Fragments published during the inner steps: their time is overhead, not steps.
            inner_s=clock.inner - clock.start + begun.inner_s - in_steps_s,
            steps_s=stats.compute_s,
            encode_s=sum(p.encode_s for p in published),
            seal_s=sum(p.seal_s for p in published),
            merge_s=sum(p.merge_s for p in published),
            eval_s=clock.evaluated - clock.merged,
        )
        accepted = any(p.result.accepted for p in published)
        report = RoundReport(
            stats=stats,
            val_loss=val_loss,
            timings=timings,
            round_s=clock.evaluated - clock.start + begun.inner_s - aside_s,
            seq=self.stats.seq if accepted else None,
            planned_steps=r.planned_steps,
            resumed_at_step=begun.steps_done,
            learner_step=r.learner_step,
            update_bytes=sum(p.update_bytes for p in published),
            aside_s=aside_s,
        )
        self.telemetry.report_round(report)

    def _on_step(self, step: StepStats) -> None:
        self.swarm.step_boundary()  # a swarm starting beside training forks its DHT here
        at = step.step + self._step_offset
        if not self._stepped:  # the end of start-up: the first inner step of this process
            self._stepped = True
            self.telemetry.events.emit(
                "startup_phase",
                name="first_batch",
                round=self.stats.round,
                step_s=round(step.seconds, 4),  # the step's own time, in the phase
            )
            if not self.stop.is_set():  # a node stopping already starts nothing more
                self._start_beside_training()
        # Once its seq and state are known; a sharded learner evaluates inline, with its
        # ranks (collectives): between rounds only.
        if self._aside is not None and self._evaluation is not None and self.swarm.caught_up():
            started = time.perf_counter()
            self._publish_aside()
            self._late_publish_s += time.perf_counter() - started
        round_ = self.stats.round + 1 + (self._aside is not None)  # the set-aside one's next
        self.telemetry.report_step(round_, at, self.planned_steps, step)
        # Fragments are published mid-round: not before the node knows its seq and state.
        if self.publishing.keeps_partial_rounds() or self.swarm.wait_caught_up(self.stop):
            self.publishing.on_step(at, step)
        self._save_partial(step)

    def _save_partial(self, step: StepStats) -> None:
        """The round so far to the checkpoint, written in the background, every 1 to
        PARTIAL_SAVE_S seconds as its cost allows (Persistence.cadence), whole updates only:
        fragment streams publish their fragments during the round."""
        segment = self._segment
        if segment is None:
            return
        segment.add(step)
        if self._aside is not None:  # the round set aside is what the checkpoint holds
            return
        due = self.persistence.cadence.due(time.monotonic() - self._saved_at)
        if not due or not self.publishing.keeps_partial_rounds():
            return
        done = segment.progress()
        if not 0 < done.steps_done < min(self.planned_steps, self.config.inner_steps):
            return
        partial = replace(done, params=self.learner.params_vector())
        if self.persistence.save_in_background(partial):
            self._saved_at = time.monotonic()

    def _evaluate_round(self, round_: int) -> None:
        """The replica after `round_`, if due: a snapshot handed to the evaluation thread
        while the loop runs (`run`). A sharded learner, and a round run by hand (`run_round`
        from tests and benchmarks, which read its loss at once), evaluate inline."""
        if not self.val_batches or not self.schedule.due(round_):
            return
        if self._evaluation is None or not self._running:
            self.report_evaluation(round_, self.evaluate())
        else:
            self._evaluation.submit(round_, self.replica.snapshot()[0])

    def evaluate(self) -> float | None:
        """Validation loss of the replica, on the training thread (None without
        --eval-batches)."""
        if not self.val_batches:
            return None
        # Streaming fragments train on across rounds: their params are put back afterwards.
        inner = self.learner.params_vector() if self.publishing.holds_learner_params() else None
        params, _ = self.replica.snapshot()
        self.learner.load_params(params)
        val_loss = round(self.learner.evaluate(self.val_batches), 6)
        if inner is not None:
            self.learner.load_params(inner)
        return val_loss

    def _planned_steps(self) -> int:
        """H, or with --dynamic-h H scaled by this learner's rate over the fastest live peer's."""
        if not self.config.dynamic_h:
            return self.config.inner_steps
        peers = self.swarm.alive_peers()
        rates = [PeerRate(h.peer_id, h.steps_per_s) for h in peers if h.state == "training"]
        return self.round_sizer.steps(rates)

    def _limit_reached(self) -> str | None:
        if self.config.max_rounds is not None and self.stats.round >= self.config.max_rounds:
            return "max_rounds"
        if self._time_exhausted():
            return "max_time"
        return "finished" if self.finish.is_set() else None

    def _time_exhausted(self) -> bool:
        limit = self.config.max_time
        return limit is not None and time.monotonic() - self.started_at >= limit

    def _should_interrupt(self) -> bool:
        return self.stop.is_set() or self._time_exhausted()
