"""bench.wire's equal-tokens runs: M learners through the node's own round publishing."""

from __future__ import annotations

import pytest
import torch

from bench.quality import Evaluator, QualityConfig
from bench.wire import WireConfig, train


@pytest.mark.slow
def test_the_learners_rounds_merge_and_repeat_bit_identically() -> None:
    torch.set_num_threads(1)
    config = WireConfig(train_learners=2, train_rounds=2, train_inner_steps=3, eval_every=1)
    ev = Evaluator(QualityConfig(model="tiny", eval_batches=2, seed=0))
    genesis = torch.nn.utils.parameters_to_vector(ev.learner(1, "g").model.parameters()).detach()
    first, again = train("int8", config, ev), train("int8", config, ev)
    assert sorted(first.curve) == [1, 2]
    # Every update was merged (train stops on a rejection) and moved the replica downhill.
    assert first.curve[2] < first.curve[1] < ev.val_loss(genesis)
    assert first.curve == again.curve
    assert first.val_loss_unlagged == again.val_loss_unlagged
