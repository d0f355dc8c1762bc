"""Validation beside training: the loss of a snapshot of the replica, computed in a thread on
a copy of the model while the learner keeps stepping (issue 23: evaluation is never on the
training path, neither before the first inner step nor after each round)."""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch.nn.utils import vector_to_parameters

from node.learner import validation_loss

EVALUATION_WAIT_S = 60.0
"""How long a stopping node waits for an evaluation still running beside training."""

logger = logging.getLogger(__name__)

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class EvaluationSchedule:
    """Which rounds' replicas are evaluated: the one at start, then every `every` rounds."""

    every: int = 1

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError("--eval-every must be at least 1")

    def due(self, round_: int) -> bool:
        """Whether the replica after round `round_` (0: at start) is evaluated."""
        return round_ % self.every == 0


class LatestLoss:
    """The validation loss of the newest round evaluated so far (evaluations finish out of
    step with training, and a skipped or late one never hides a newer figure)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: tuple[int, float] | None = None

    def record(self, round_: int, val_loss: float) -> None:
        with self._lock:
            if self._latest is None or round_ >= self._latest[0]:
                self._latest = (round_, val_loss)

    @property
    def val_loss(self) -> float | None:
        latest = self._latest
        return None if latest is None else latest[1]


class BackgroundEvaluation:
    """Evaluates snapshots one at a time on its own copy of the model; reports each loss.

    The copy is made once, on the first submit, from the learner's module (its parameters
    are overwritten by every snapshot): the learner's own module keeps training meanwhile.
    At most one snapshot waits while another is evaluated: a newer one replaces it (slow
    evaluations are thinned, never queued without bound).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        batches: Batches,
        device: torch.device,
        report: Callable[[int, float], None],
    ) -> None:
        self._source, self._batches, self._device = model, batches, device
        self._report = report
        self._model: torch.nn.Module | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="evaluation")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self.num_skipped = 0
        """Snapshots replaced by a newer one before their evaluation began."""

    def submit(self, round_: int, params: torch.Tensor) -> None:
        """Evaluate `params` (a flat snapshot, not shared with training) for `round_`."""
        if self._model is None:
            self._model = copy.deepcopy(self._source)
        with self._lock:
            waiting = [f for f in self._pending if not f.done()]
            self.num_skipped += sum(f.cancel() for f in waiting)  # False for the running one
            future = self._pool.submit(self._evaluate, self._model, round_, params)
            self._pending = [f for f in waiting if not f.cancelled()] + [future]

    def wait(self, timeout_s: float) -> None:
        """Let the evaluations submitted so far finish (bounded), then stop the thread."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            try:
                future.result(timeout=timeout_s)
            except TimeoutError:
                logger.warning("an evaluation did not finish within %.0f s", timeout_s)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _evaluate(self, model: torch.nn.Module, round_: int, params: torch.Tensor) -> None:
        try:
            with torch.no_grad():
                vector_to_parameters(params.to(self._device), model.parameters())
            val_loss = validation_loss(model, self._batches, self._device)
        except Exception:  # a failed evaluation costs its figure, never the training
            logger.exception("evaluating the replica of round %d failed", round_)
            return
        self._report(round_, round(val_loss, 6))
