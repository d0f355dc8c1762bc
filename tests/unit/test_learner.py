from pathlib import Path

import pytest
import torch
from torch import nn

from node.data import ShardSampler, load_corpus, split_corpus
from node.learner import InnerConfig, Learner, _next_step_overruns

CORPUS = str(Path(torch.__file__).parent / "functional.py")


class Bigram(nn.Module):
    """A byte bigram model: the learner's contract (x, y) -> (logits, loss), in microseconds."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Embedding(256, 256)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(x)
        return logits, nn.functional.cross_entropy(logits.view(-1, 256), y.reshape(-1))


def make_learner(speed_factor: float = 1.0, emulated_step_s: float | None = None) -> Learner:
    corpus = load_corpus(CORPUS)
    sampler = ShardSampler(split_corpus(corpus).train, seed="t", batch_size=2, block_size=16)
    inner = InnerConfig(
        lr=1e-3, weight_decay=0.1, grad_clip=1.0, warmup_steps=2, decay_steps=10,
        speed_factor=speed_factor, emulated_step_s=emulated_step_s,
    )  # fmt: skip
    return Learner(Bigram(), sampler, inner, torch.device("cpu"))


@pytest.fixture(scope="module", autouse=True)
def _warm_torch() -> None:
    """torch's one-off first-step costs, paid at full speed rather than three times over."""
    make_learner().run_round(2, lambda: False, lambda _: None)


def test_speed_factor_really_slows_the_inner_steps() -> None:
    stats = make_learner(speed_factor=3.0).run_round(3, lambda: False, lambda _: None)

    real_s = stats.compute_s - stats.emulated_s
    assert stats.num_steps == 3
    assert stats.emulated_s >= 0.9 * 2.0 * real_s  # it slept F-1 = 2 times each step
    assert make_learner().run_round(1, lambda: False, lambda _: None).emulated_s == 0.0


def test_paced_steps_last_factor_times_the_emulated_step_time() -> None:
    learner = make_learner(speed_factor=2.0, emulated_step_s=0.04)
    stats = learner.run_round(3, lambda: False, lambda _: None)

    assert stats.compute_s >= 3 * 2 * 0.04  # each step padded to 80 ms, whatever it took
    # The pad is what the step left of 80 ms (none for a step slower than that: a loaded box).
    assert learner._emulate_slower_hardware(0.03) >= 0.05
    assert learner._emulate_slower_hardware(0.5) == 0.0


def test_a_timed_round_takes_at_least_one_step_and_at_most_h() -> None:
    learner = make_learner()

    one = learner.run_round(5, lambda: False, lambda _: None, max_seconds=0.0)
    full = learner.run_round(3, lambda: False, lambda _: None, max_seconds=3600.0)

    assert (one.num_steps, one.stopped_early) == (1, False)  # a complete (short) round
    assert (full.num_steps, full.stopped_early) == (3, False)


def test_a_stopped_round_is_marked_partial() -> None:
    stats = make_learner().run_round(5, lambda: True, lambda _: None)

    assert (stats.num_steps, stats.stopped_early) == (0, True)


@pytest.mark.parametrize(
    ("max_seconds", "spent_s", "steps", "overruns"),
    [(None, 100.0, 10, False), (10.0, 0.0, 0, False), (10.0, 8.0, 4, False),
     (10.0, 9.0, 4, True), (0.0, 0.1, 1, True)],
)  # fmt: skip
def test_next_step_overruns_by_the_rounds_mean_step(
    max_seconds: float | None, spent_s: float, steps: int, overruns: bool
) -> None:
    assert _next_step_overruns(max_seconds, spent_s, steps) is overruns


def test_speed_factor_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        make_learner(speed_factor=0.5)
