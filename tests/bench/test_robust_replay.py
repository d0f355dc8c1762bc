"""bench.robust_replay's honest learners: the node's Learner, trained and merged."""

from __future__ import annotations

import pytest
import torch

from bench.robust_replay import replay, zero_flood


@pytest.mark.slow
def test_the_honest_learners_descend_and_a_replay_repeats_bit_identically() -> None:
    torch.set_num_threads(1)
    # Two rounds are the fewest that show both: a later round descends, and the flood (from
    # round 1, once the honest learners have a round applied) is met.
    one, two = replay(None, 1, seed=0, start=0, learners=2), replay(None, 2, 0, 0, 2)
    assert two["val_loss"] < one["val_loss"]
    assert replay(None, 2, 0, 0, 2) == two
    flooded = replay(zero_flood, 2, seed=0, start=1, learners=2)
    assert flooded["rejections"], "the flood's zeros were all taken as honest updates"
