"""Evaluation beside training: the loss of the snapshot submitted, not of the model as it
trained on meanwhile, and the training model untouched."""

from __future__ import annotations

import copy

import torch
from torch.nn.utils import parameters_to_vector

from node.evaluation import BackgroundEvaluation
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
