"""Validation beside training: the loss of a snapshot of the replica, computed in a thread on
a copy of the model while the learner keeps stepping (issue 23: evaluation is never on the
path to the first inner step)."""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.nn.utils import vector_to_parameters

from node.learner import validation_loss

logger = logging.getLogger(__name__)

Batches = list[tuple[torch.Tensor, torch.Tensor]]


class BackgroundEvaluation:
    """Evaluates snapshots one at a time on its own copy of the model; reports each loss.

    The copy is made once, on the first submit, from the learner's module (its parameters
    are overwritten by every snapshot): the learner's own module keeps training meanwhile.
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

    def submit(self, round_: int, params: torch.Tensor) -> None:
        """Evaluate `params` (a flat snapshot, not shared with training) for `round_`."""
        if self._model is None:
            self._model = copy.deepcopy(self._source)
        future = self._pool.submit(self._evaluate, self._model, round_, params)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [future]

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
        with torch.no_grad():
            vector_to_parameters(params.to(self._device), model.parameters())
        val_loss = validation_loss(model, self._batches, self._device)
        self._report(round_, round(val_loss, 6))
