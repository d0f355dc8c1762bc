"""Evaluation beside training: the loss of the snapshot submitted, not of the model as it
trained on meanwhile, and the training model untouched."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn.utils import parameters_to_vector

from node.evaluation import BackgroundEvaluation, EvaluationSchedule, LatestLoss
from node.learner import validation_loss

CPU = torch.device("cpu")


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.linear(x)
        return out, torch.nn.functional.mse_loss(out, y)


def test_the_snapshot_is_evaluated_while_the_model_trains_on() -> None:
    torch.manual_seed(0)
    model = Regression()
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    at_start = copy.deepcopy(model)
    snapshot = parameters_to_vector(model.parameters()).detach().clone()
    reported: list[tuple[int, float]] = []
    evaluation = BackgroundEvaluation(model, batches, CPU, lambda r, v: reported.append((r, v)))

    evaluation.submit(7, snapshot)
    with torch.no_grad():  # training goes on meanwhile
        for p in model.parameters():
            p.add_(1.0)
    trained = parameters_to_vector(model.parameters()).detach().clone()
    evaluation.wait(30.0)

    assert reported == [(7, round(validation_loss(at_start, batches, CPU), 6))]
    assert torch.equal(parameters_to_vector(model.parameters()).detach(), trained)
    assert reported[0][1] != round(validation_loss(model, batches, CPU), 6)


def test_a_newer_snapshot_replaces_one_still_waiting_and_the_last_is_evaluated() -> None:
    torch.manual_seed(0)
    model = Regression()
    batches = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(2)]
    release = threading.Event()
    reported: list[int] = []

    def report(round_: int, _: float) -> None:
        release.wait(30)  # holds the evaluation thread on round 1's result
        reported.append(round_)

    evaluation = BackgroundEvaluation(model, batches, CPU, report)
    snapshot = parameters_to_vector(model.parameters()).detach().clone()
    for round_ in (1, 2, 3, 4):
        evaluation.submit(round_, snapshot.clone())
    release.set()
    evaluation.wait(30.0)

    assert reported == [1, 4]  # 1 was running; 2 and 3 were replaced while waiting
    assert evaluation.num_skipped == 2


def test_a_failed_evaluation_costs_its_figure_not_the_caller() -> None:
    model = Regression()
    reported: list[int] = []
    evaluation = BackgroundEvaluation(model, [], CPU, lambda r, v: reported.append(r))
    evaluation.submit(1, torch.zeros(3))  # the wrong size: vector_to_parameters raises
    evaluation.wait(30.0)
    assert reported == []


@given(st.integers(1, 50), st.integers(0, 10_000))
def test_the_replica_at_start_is_always_due_and_every_kth_round_after(
    every: int, round_: int
) -> None:
    schedule = EvaluationSchedule(every)
    assert schedule.due(0)
    assert schedule.due(round_) == (round_ % every == 0)
    assert sum(schedule.due(r) for r in range(1, 10 * every + 1)) == 10


def test_eval_every_below_one_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match="--eval-every must be at least 1"):
        EvaluationSchedule(0)


@given(st.lists(st.tuples(st.integers(0, 100), st.floats(0, 10)), max_size=30))
def test_the_latest_loss_is_the_newest_rounds_whatever_the_finishing_order(
    finished: list[tuple[int, float]],
) -> None:
    latest = LatestLoss()
    for round_, val_loss in finished:
        latest.record(round_, val_loss)
    if not finished:
        assert latest.val_loss is None
        return
    newest = max(r for r, _ in finished)
    assert latest.val_loss == [v for r, v in finished if r == newest][-1]
