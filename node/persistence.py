"""A node's checkpoints: what it saves (replica, learner, partial round, error feedback, what
judged its updates), and resuming from them. The file format lives in node.checkpoint."""

from __future__ import annotations

import copy
import shlex
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from merge.feedback import Compressor
from merge.pipeline import UpdatePipeline
from merge.replica import Replica
from node.checkpoint import (
    CheckpointError,
    Layout,
    load_checkpoint,
    read_manifest,
    save_checkpoint,
)
from node.events import EventLog
from node.fingerprint import describe_differences, join_arguments, settings_differences
from node.learner import Learner
from node.progress import RoundProgress
from node.save_cadence import SaveCadence
from node.seq_ledger import SeqLedger
from node.stats import NodeStats
from node.streaming import FragmentCompressors

PARTIAL_SAVE_S = 5.0
"""A round in progress is checkpointed (in the background) at least this often: a kill -9
loses at most the inner steps since, plus the write."""
PARTIAL_SAVE_MIN_S = 1.0
"""...and as often as this when the save is cheap (node.save_cadence: the copy under 1 % of
the training thread's time, the write under 5 % of the wall time)."""


class Persistence:
    """Saves the node's state to its checkpoint directory and resumes from it."""

    def __init__(
        self,
        *,
        checkpoint_dir: Path,
        fingerprint: str,
        model: dict[str, Any],
        settings: dict[str, Any],
        peer_id: str,
        inner_steps: int,
        replica: Replica,
        pipeline: UpdatePipeline,
        learner: Learner,
        error_feedback: Compressor | FragmentCompressors,
        stats: NodeStats,
        seq_ledger: SeqLedger,
        events: EventLog,
        replica_changed: Callable[[], None],
        saved: Callable[[], None] = lambda: None,
    ) -> None:
        """`settings`: the run's fingerprint settings (node.fingerprint), recorded so that a
        node of another configuration is told which differ. `saved` runs after each
        checkpoint (the swarm remembers its peers beside it)."""
        self.checkpoint_dir, self.fingerprint, self.model = checkpoint_dir, fingerprint, model
        self.settings = settings
        self.peer_id, self.inner_steps = peer_id, inner_steps
        self.replica, self.pipeline, self.learner = replica, pipeline, learner
        self.error_feedback, self.stats, self.seq_ledger = error_feedback, stats, seq_ledger
        self.events, self.replica_changed, self.saved = events, replica_changed, saved
        self._writing = threading.Lock()
        """One checkpoint write at a time: each removes the generations before its own."""
        self._background: threading.Thread | None = None
        self._failed: BaseException | None = None
        """What a background write raised: raised on the training thread at its next save."""
        self.cadence = SaveCadence(min_s=PARTIAL_SAVE_MIN_S, max_s=PARTIAL_SAVE_S)
        """How often a round in progress is saved (node.trainer asks)."""

    def state_dict(self, partial: RoundProgress | None) -> dict[str, Any]:
        return {**self._own_state(partial), **self._shared_state()}

    def _own_state(self, partial: RoundProgress | None) -> dict[str, Any]:
        """What the training thread changes (the learner, the round, the counters), copied
        at this moment: the training thread's part of a save."""
        return {
            "fingerprint": self.fingerprint,
            "model": self.model,
            "settings": self.settings,
            "peer_id": self.peer_id,
            "round": self.stats.round,
            "seq": self.stats.seq,
            "learner": _copied(self.learner.state_dict()),
            # Its base is never changed in place, its params are a fresh vector.
            "partial_round": partial.state_dict() if partial is not None else None,
            # The highest seq this identity had sealed when the partial round was saved.
            "sealed_seq": self.seq_ledger.last(),
            "error_feedback": self.error_feedback.state_dict(),  # a copy
            # When this was copied: a restart's `resumed` says what it kept (bench.chaos).
            "copied_at": time.time(),
        }

    def _shared_state(self) -> dict[str, Any]:
        """The replica and what judged its updates, copied at one moment (merges change them
        from other threads; a background write takes them when it runs)."""
        with self.replica.lock:
            return {
                "replica": self.replica.state_dict(),
                "merge": copy.deepcopy(self.pipeline.state_dict()),
                "equivocation": copy.deepcopy(self.pipeline.equivocation.state_dict()),
            }

    def param_layout(self) -> Layout:
        """The model's parameters in the replica's flat order (names for the weights file)."""
        return [(name, p.shape) for name, p in self.learner.model.named_parameters()]

    def save(self, partial: RoundProgress | None) -> None:
        """Write the state now, after a background write still running, if any (so that an
        older state never lands after this one); then the `saved` hook."""
        self.wait_for_background()
        self._write(self.state_dict(partial), partial)
        self.saved()

    def save_beside(self, partial: RoundProgress | None) -> None:
        """The end of a round's save, off the training thread: the training thread's part of
        the state copied now, the rest taken and written in a thread, after a background write
        still running (never skipped, never out of order), then the `saved` hook. A kill -9
        meanwhile leaves the previous generation (node.checkpoint writes atomically)."""
        self._start_background(partial, after=self._background, periodic=False)

    def save_in_background(self, partial: RoundProgress) -> bool:
        """A mid-round save: copy the training thread's part of the state now, take the
        replica's and write it all in a thread; False (nothing done) while the previous
        background write still runs. The copy is what the training thread pays (`cadence`
        measures it and the write). A replica taken a moment after the round's copy is one
        that merged a little more before the save: what a restart catches up from anyway."""
        if self._background is not None and self._background.is_alive():
            return False
        self._start_background(partial, after=None, periodic=True)
        return True

    def wait_for_background(self, timeout_s: float | None = None) -> None:
        """Until the background write in flight, if any, is on disk; raises what a background
        write raised (a full disk stops the node as a save on the training thread did)."""
        writing = self._background
        if writing is not None:
            writing.join(timeout_s)
        self._raise_failure()

    def _raise_failure(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def _start_background(
        self, partial: RoundProgress | None, *, after: threading.Thread | None, periodic: bool
    ) -> None:
        self._raise_failure()
        started, copied_at = time.perf_counter(), time.time()
        own = {**self._own_state(partial), "copied_at": copied_at}
        self.cadence.observe_copy(time.perf_counter() - started)
        self._background = threading.Thread(
            target=self._write_in_background,
            args=(own, partial, copied_at, after, periodic),
            name="checkpoint",
            daemon=True,
        )
        self._background.start()

    def _write_in_background(
        self,
        own: dict[str, Any],
        partial: RoundProgress | None,
        copied_at: float,
        after: threading.Thread | None,
        periodic: bool,
    ) -> None:
        if after is not None:
            after.join()  # the one before first: generations land in the order copied
        started = time.perf_counter()
        try:
            self._write({**own, **self._shared_state()}, partial, copied_at, periodic=periodic)
        except Exception as exc:  # noqa: BLE001 - raised on the training thread, next save
            self._failed = exc
            return
        self.cadence.observe_write(time.perf_counter() - started)
        if not periodic:
            self.saved()

    def _write(
        self,
        state: dict[str, Any],
        partial: RoundProgress | None,
        copied_at: float | None = None,
        *,
        periodic: bool = False,
    ) -> None:
        """`copied_at`: written in the background, its state copied then; `periodic`: one of
        the mid-round saves every few seconds (`background` in the event: the event log keeps
        them, the console does not print them)."""
        with self._writing:
            path = save_checkpoint(self.checkpoint_dir, state, self.param_layout())
        step = partial.steps_done if partial is not None else 0
        self.events.emit(
            "checkpoint_saved",
            path=str(path),
            round=state["round"],
            step=step,
            background=periodic,
            **({"copied_at": copied_at} if copied_at is not None else {}),
        )

    def resume(self) -> RoundProgress | None:
        """Load the last checkpoint, if any; the round it stopped midway, if it did.

        A partial round is saved every few seconds in the background, and a round is
        published without a save after it: a kill -9 in the next round finds the last round's
        partial on disk. The seq ledger (written before every seal) tells: a seq sealed after
        the one the checkpoint recorded (`sealed_seq`) means that round was finished and
        published since, and resuming it would publish its steps twice (a duplicate
        pseudo-gradient). It is dropped (`stale_partial_step` in the `resumed` event); the
        learner's state (optimizer, step, data position) stays as saved. Not told apart: a
        round sealed under the seq of an own update our pipeline rejected just before (the
        ledger does not move)."""
        path = self.checkpoint_dir
        check_same_run(path, self.fingerprint, self.settings)
        state = load_checkpoint(path, self.fingerprint, self.param_layout())
        if state is None:
            return None
        try:
            partial, own_seq = self._load(state)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint in {path} is damaged ({exc})") from None
        sealed = self.seq_ledger.last()
        sealed_then = state.get("sealed_seq")  # absent from checkpoints before it: kept
        stale = partial if type(sealed_then) is int and sealed > sealed_then else None
        if stale is not None:  # finished and sealed after it was saved: never twice
            partial = None
        # A node that rejoins with the same identity continues its seq numbers.
        last_seq = max(own_seq, self.replica.last_seq(self.peer_id), sealed, 0)
        self.stats.set_seq(last_seq)
        self.replica_changed()
        self.events.emit(
            "resumed",
            path=str(self.checkpoint_dir),
            round=self.stats.round,
            step=partial.steps_done if partial is not None else 0,
            num_applied=self.replica.num_applied,
            stale_partial_step=stale.steps_done if stale is not None else None,
            copied_at=_float_or_none(state.get("copied_at")),  # absent before it
        )
        return partial

    def _load(self, state: dict[str, Any]) -> tuple[RoundProgress | None, int]:
        self.replica.load_state_dict(state["replica"])
        self.learner.load_state_dict(state["learner"])
        if "error_feedback" in state:  # checkpoints before codecs with error feedback lack it
            self.error_feedback.load_state_dict(state["error_feedback"])
        # Proven equivocations and the ids settled in this replica (merge.equivocation).
        self.pipeline.equivocation.load_state_dict(state.get("equivocation"), self.fingerprint)
        # The robust windows and the learner floor (checkpoints before them lack "merge").
        self.pipeline.load_state_dict(state.get("merge"))
        self.stats.set_round(int(state["round"]))
        own_seq = int(state["seq"]) if state["peer_id"] == self.peer_id else 0
        partial = state.get("partial_round")
        if partial is None:
            return None, own_seq
        numel = self.replica.numel
        return RoundProgress.from_state_dict(partial, numel, self.inner_steps), own_seq


def check_same_run(directory: Path, fingerprint: str, settings: dict[str, Any]) -> None:
    """A checkpoint of another configuration: CheckpointError naming the settings that differ
    and the flags that resume it (a checkpoint from before recorded settings: load_checkpoint's
    plainer error)."""
    manifest = read_manifest(directory)
    theirs = manifest.get("settings")
    if manifest.get("fingerprint") in (None, fingerprint) or not isinstance(theirs, dict):
        return
    differences = settings_differences(theirs, settings)
    flags = join_arguments({name: theirs_value for name, (theirs_value, _) in differences.items()})
    resume = f"pass {shlex.join(flags)} to resume it" if flags else "resume it with its settings"
    raise CheckpointError(
        f"checkpoint in {directory} belongs to a different run or model configuration "
        f"({describe_differences({'settings': theirs}, settings, label='checkpoint')}); "
        f"{resume}, or another --checkpoint-dir"
    )


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _copied(value: Any) -> Any:
    """`value` with every tensor in it cloned (dicts, lists and tuples rebuilt): far cheaper
    than copy.deepcopy for an optimizer's state of many small tensors."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    return value
