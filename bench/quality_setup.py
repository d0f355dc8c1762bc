"""bench.quality's setup: its settings (:class:`QualityConfig`, also read by bench.wire,
bench.wire_grid and bench.correction_sim) and the :class:`Evaluator` every run is judged by
(the same model, corpus, inner AdamW and validation batches). Moved out of bench/quality.py
unchanged (session 24), which re-exports both.
"""

from __future__ import annotations

import pydantic.dataclasses
import torch

from node.builders import build_run_spec, inner_config
from node.data import ShardSampler, load_corpus, split_corpus, validation_batches
from node.learner import Learner
from node.model import build_model
from node.settings import FLAGS, RunSettings, TrainSettings

SIZINGS = ("round-time", "dynamic-h", "fixed-h")
METHODS = ("sync", "async", "async_uncorrected")


@pydantic.dataclasses.dataclass(kw_only=True, config=FLAGS)
class QualityConfig:
    """Equal-token comparison settings."""

    learners: int = 4
    """M: learners of the synchronous and asynchronous runs."""
    rounds: int = 10
    """Rounds of H inner steps per learner (the single learner runs M x rounds x H steps)."""
    inner_steps: int = 20
    """H."""
    model: str = "tiny"
    """Model preset."""
    eval_batches: int = 16
    """Validation batches for the final evaluation of each model."""
    seed: int = 0
    """Genesis seed shared by every run."""
    threads: int = 1
    """torch threads per learner process (the single learner uses learners x threads)."""
    hetero: str | None = None
    """Mixed hardware at equal wall time: comma-separated slow-down factors, one learner each."""
    budget_s: float = 150.0
    """--hetero: wall-clock seconds of training per run."""
    round_time: float | None = None
    """--hetero: the async round time (default: H steps of the fastest learner)."""
    sizing: str = "round-time"
    """--hetero: how async rounds are sized: round-time (a fixed wall time per round) or
    dynamic-h (each learner's H follows its measured throughput, `join --dynamic-h`) or fixed-h
    (every learner runs H steps, so slower learners publish rarer, staler updates)."""
    non_iid: bool = False
    """--hetero: learner i trains only on the i-th of M contiguous slices of the corpus
    (`--data-slice i/M`), so the learners' data differ, as in HeLoCo's non-IID setting."""
    correction: str = "heloco"
    """--hetero: the corrected async run's --correction (heloco or lookahead)."""
    correction_strength: float | None = None
    """--hetero: the corrected async run's --correction-strength (default: 10 for heloco, HeLoCo's
    k_s, since at 1 it removes well under 1 % of a block; 1 for lookahead)."""
    seeds: str | None = None
    """--hetero: comma-separated genesis seeds, every method run once per seed (default: --seed)."""
    methods: str = ",".join(METHODS)
    """--hetero: which runs, of sync, async (corrected) and async_uncorrected."""
    concurrent: bool = False
    """--hetero: run async and async_uncorrected at the same time (2 x the learners), so both
    see the same machine load: on a shared machine, one after the other, a paced step that
    the load outruns costs one run tokens the other keeps. With fewer cores than learners the
    fast learners are CPU-bound and the speed ratios shrink (2 cores, 1,2,4: rounds per node
    24 / 20 / 12 instead of 48 / 24 / 12): check `rounds_per_node`."""
    pace: float = 2.0
    """--hetero: every learner's step lasts factor x pace x the calibrated step time (slept
    out), so runs get equal compute on a shared machine; 0 sleeps factor-1 x each measured
    step instead, and the machine's load then varies each run's compute."""

    def speeds(self) -> list[float]:
        """The slow-down factors of --hetero (empty without it)."""
        if not self.hetero:
            return []
        try:
            speeds = [float(f) for f in self.hetero.split(",")]
        except ValueError:
            raise ValueError(f"--hetero takes factors such as 1,2,4; got {self.hetero!r}") from None
        if self.sizing not in SIZINGS:
            raise ValueError(f"--sizing must be one of {', '.join(SIZINGS)}, not {self.sizing!r}")
        if len(speeds) < 2 or not all(1.0 <= f <= 100.0 for f in speeds):
            raise ValueError(f"--hetero needs two or more factors in [1, 100], not {self.hetero!r}")
        return speeds

    def strength(self) -> float:
        """The corrected run's --correction-strength."""
        if self.correction not in ("heloco", "lookahead"):
            raise ValueError(f"--correction must be heloco or lookahead, not {self.correction!r}")
        if self.correction_strength is not None:
            return self.correction_strength
        return 10.0 if self.correction == "heloco" else 1.0

    def seed_list(self) -> list[int]:
        """The genesis seeds of --seeds (just --seed without it)."""
        if not self.seeds:
            return [self.seed]
        try:
            seeds = [int(s) for s in self.seeds.split(",")]
        except ValueError:
            raise ValueError(f"--seeds takes integers such as 0,1,2; got {self.seeds!r}") from None
        if len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
            raise ValueError(f"--seeds needs distinct seeds >= 0, not {self.seeds!r}")
        return seeds

    def method_list(self) -> list[str]:
        """The runs of --methods, in the order of METHODS."""
        names = {m.strip() for m in self.methods.split(",")}
        if not names or not names <= set(METHODS):
            raise ValueError(f"--methods takes some of {','.join(METHODS)}, not {self.methods!r}")
        return [m for m in METHODS if m in names]


class Evaluator:
    """The shared model shape and validation batches; evaluates flat parameter vectors."""

    def __init__(self, config: QualityConfig) -> None:
        self.corpus = load_corpus(None)
        self.split = split_corpus(self.corpus)
        # The model and batch a node of this run builds (node.builders, from its settings).
        spec = build_run_spec(RunSettings(model=config.model, seed=config.seed), self.corpus)
        self.model_config = spec.model
        self.batch_size = spec.batch_size
        self.config = config
        self.batches = validation_batches(
            self.split.val,
            batch_size=self.batch_size,
            block_size=self.model_config.block_size,
            num_batches=config.eval_batches,
        )

    def learner(self, steps: int, seed: str, speed_factor: float = 1.0) -> Learner:
        """The node's Learner at the node's inner defaults (node.builders.inner_config of a
        train section), decaying over `steps`; `seed` seeds its batches."""
        model = build_model(self.model_config, self.config.seed)
        sampler = ShardSampler(
            self.split.train,
            seed=seed,
            batch_size=self.batch_size,
            block_size=self.model_config.block_size,
        )
        train = TrainSettings(
            model=self.config.model, lr_decay_steps=steps, speed_factor=speed_factor
        )
        return Learner(model, sampler, inner_config(train), torch.device("cpu"))

    def val_loss(self, params: torch.Tensor) -> float:
        learner = self.learner(1, "eval")
        learner.load_params(params)
        return round(learner.evaluate(self.batches), 5)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model_config.block_size
