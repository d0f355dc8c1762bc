"""bench.robust_replay's honest learners: the node's Learner, trained and merged."""

from __future__ import annotations

import pytest
import torch

from bench.robust_replay import replay, zero_flood


@pytest.mark.slow
def test_the_honest_learners_descend_and_a_replay_repeats_bit_identically() -> None:
    torch.set_num_threads(1)
    one, three = replay(None, 1, seed=0, start=0, learners=2), replay(None, 3, 0, 0, 2)
    assert three["val_loss"] < one["val_loss"]
    assert replay(None, 3, 0, 0, 2) == three
    flooded = replay(zero_flood, 3, seed=0, start=1, learners=2)
    assert flooded["rejections"], "the flood's zeros were all taken as honest updates"
