"""Synchronous baselines on hivemind's DecentralizedAverager (the all-reduce OpenDiLoCo uses).

    python -m bench.sync_baseline --mode diloco --num-nodes 4 --peers MADDR ...   # one worker

One worker per node, the same model, data sampling and inner AdamW as `diloco-node`:
- diloco: synchronous DiLoCo. H inner steps, then every live worker all-reduces its
  pseudo-gradient (DecentralizedAverager.step with target_group_size = num_nodes) and applies
  the mean with outer Nesterov SGD (lr 0.7, momentum 0.9). A round whose all-reduce fails or
  finds nobody is lost; a worker that lost a round or restarted downloads the current state
  from a peer (DecentralizedAverager.load_state_from_peers) before training on.
- dp: a data-parallel-style barrier every step: the same loop with H = --dp-inner-steps
  (default 1) and plain averaging of the parameter deltas (outer lr 1, no momentum).

Prints one JSON event per line: listening, started, round_done {round, inner_s, round_s,
wait_s, committed, group_size}, state_loaded, checkpoint_saved, stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pydantic.dataclasses
import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.utils import get_dht_time

from merge.outer import NesterovSGD
from node.config import add_config_arguments, config_from_args
from node.data import ShardSampler, data_slice, load_corpus, split_corpus
from node.learner import InnerConfig, Learner
from node.model import DEFAULT_BATCH_SIZE, DEFAULT_INNER_LR, build_model, model_config
from node.settings import FLAGS

logger = logging.getLogger(__name__)
CHECKPOINT_FILE = "sync_checkpoint.pt"
BARRIER_WAIT_S = 60.0
"""Longest wait of a worker that is behind for the others' next barrier."""
LOST_IN_A_ROW = 4
"""With --max-rounds: rounds lost in a row after which a worker takes the others to have
finished the run without it (it fell behind and nobody is left to average with)."""


@pydantic.dataclasses.dataclass(kw_only=True, config=FLAGS)
class WorkerConfig:
    """One synchronous worker."""

    mode: str = "diloco"
    """diloco (all-reduce of pseudo-gradients every H steps) or dp (every step)."""
    rank: int = 0
    """This worker's slot; seeds its data shard."""
    data_slice: str | None = None
    """K/N: train only on the K-th of N contiguous slices of the training split (as join)."""
    num_nodes: int = 4
    """Workers in the run: the all-reduce group size aimed for."""
    run_id: str = "sync"
    """Name of the run; workers of one run average together."""
    model: str = "tiny"
    """Model preset (as diloco-node)."""
    seed: int = 0
    """Genesis seed (as diloco-node)."""
    inner_steps: int = 20
    """H for diloco mode."""
    dp_inner_steps: int = 1
    """Steps between barriers in dp mode."""
    outer_lr: float = 0.7
    """Outer Nesterov learning rate (diloco mode)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (diloco mode)."""
    warmup_steps: int = 100
    """Inner warmup steps (as diloco-node)."""
    lr_decay_steps: int = 100_000
    """Inner cosine decay horizon in steps (as diloco-node without --max-rounds)."""
    max_rounds: int | None = None
    """Stop after this many committed rounds (default: run until interrupted)."""
    max_time: float | None = None
    """Stop after this many seconds of training from the start barrier (a round in flight is
    lost, as an async node's is)."""
    speed_factor: float = 1.0
    """Emulated slower hardware: each inner step is followed by a sleep of F-1 times its
    duration (as diloco-node --speed-factor)."""
    emulated_step_s: float | None = None
    """With --speed-factor F: each inner step lasts F times this (as diloco-node)."""
    threads: int = 1
    """CPU threads for torch."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 0
    """TCP port to listen on (0: any free port)."""
    peers: list[str] | None = None
    """Multiaddrs of any workers to join through."""
    matchmaking_s: float = 2.0
    """How long a group leader waits for missing workers before averaging without them."""
    allreduce_timeout_s: float = 10.0
    """An all-reduce not done by then fails, and so does the round."""
    checkpoint_dir: str = "~/.diloco/sync"
    """Where the worker's checkpoint lives; a restarted worker resumes from it."""
    start_file: str | None = None
    """Wait for this file to exist before training: a start barrier set by the launcher."""
    final_params: str | None = None
    """Write the final global parameters here (torch.save of a flat fp32 tensor) on exit."""


class StateAverager(DecentralizedAverager):
    """Averages pseudo-gradients; serves the global state (round, params, momentum) to peers."""

    def __init__(self, worker: SyncWorker, **kwargs: Any) -> None:
        self.worker = worker
        super().__init__(**kwargs)

    def get_current_state(self) -> tuple[Any, list[torch.Tensor], Any]:
        with self.worker.lock:
            outer = self.worker.outer.state_dict()
            params = self.worker.params.clone()
            metadata = {"round": self.worker.round, "count": outer["count"]}
        buf = outer["buf"]
        assert isinstance(buf, torch.Tensor)
        return metadata, [params, buf], None


def make_learner(config: WorkerConfig) -> Learner:
    """The same model, data sampling and inner AdamW as a `diloco-node` learner."""
    corpus = load_corpus(None)
    split = split_corpus(corpus)
    shape = model_config(config.model, corpus.vocab_size)
    sampler = ShardSampler(
        data_slice(split.train, config.data_slice),
        seed=f"{config.run_id}/sync{config.rank}",
        batch_size=DEFAULT_BATCH_SIZE[config.model],
        block_size=shape.block_size,
    )
    inner = InnerConfig(
        lr=DEFAULT_INNER_LR[config.model],
        weight_decay=0.1,
        grad_clip=1.0,
        warmup_steps=config.warmup_steps,
        decay_steps=config.lr_decay_steps,
        speed_factor=config.speed_factor,
        emulated_step_s=config.emulated_step_s,
    )
    return Learner(build_model(shape, config.seed), sampler, inner, torch.device("cpu"))


class SyncWorker:
    """One synchronous learner: rounds of inner steps, each closed by an all-reduce barrier."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        torch.set_num_threads(config.threads)
        self.learner = make_learner(config)
        self.params = self.learner.params_vector().clone()
        dp = config.mode == "dp"
        self.inner_steps = config.dp_inner_steps if dp else config.inner_steps
        lr, momentum = (1.0, 0.0) if dp else (config.outer_lr, config.outer_momentum)
        self.outer = NesterovSGD(lr=lr, momentum=momentum, numel=self.params.numel())
        self.lock = threading.Lock()
        self.round = 0
        self.lost_in_a_row = 0
        self.stop = threading.Event()
        self.started_at: float | None = None
        self.checkpoint_path = Path(config.checkpoint_dir).expanduser() / CHECKPOINT_FILE

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        c = self.config
        self._resume()
        self.dht = DHT(
            initial_peers=c.peers or None, host_maddrs=[f"/ip4/{c.host}/tcp/{c.port}"], start=True
        )
        self.grad = torch.zeros_like(self.params)
        self.averager = StateAverager(
            self,
            averaged_tensors=[self.grad],
            dht=self.dht,
            start=True,
            prefix=f"{c.run_id}_{c.mode}",
            target_group_size=c.num_nodes,
            min_group_size=2,
            min_matchmaking_time=c.matchmaking_s,
            request_timeout=min(1.0, c.matchmaking_s / 2),
            allreduce_timeout=c.allreduce_timeout_s,
            next_chunk_timeout=c.allreduce_timeout_s / 2,
        )
        maddrs = [str(m) for m in self.dht.get_visible_maddrs()]
        emit("listening", peer_id=str(self.dht.peer_id), maddrs=maddrs)
        while c.start_file and not Path(c.start_file).exists() and not self.stop.is_set():
            time.sleep(0.1)
        if c.peers:
            self.catch_up(wait_for_barrier=self._swarm_round() > 0)
        self.started_at = time.monotonic()
        emit("started", peer_id=str(self.dht.peer_id), round=self.round, rank=c.rank)

    def run(self) -> str:
        while not self.stop.is_set():
            if self.config.max_rounds is not None and self.round >= self.config.max_rounds:
                return "max_rounds"
            if self.left_behind():
                return "left_behind"
            if self.time_exhausted():
                return "max_time"
            self.run_round()
        return "interrupted"

    def left_behind(self) -> bool:
        """The others finished their --max-rounds without this worker: the swarm announced
        the last round, or no one averaged with it for LOST_IN_A_ROW rounds (gone, their
        announcements expired with them). Training on alone would never end."""
        limit = self.config.max_rounds
        if limit is None or self.lost_in_a_row == 0:
            return False
        return self.lost_in_a_row >= LOST_IN_A_ROW or self._swarm_round() >= limit

    def time_exhausted(self) -> bool:
        limit, started = self.config.max_time, self.started_at
        return limit is not None and started is not None and time.monotonic() - started >= limit

    def should_stop(self) -> bool:
        return self.stop.is_set() or self.time_exhausted()

    def shutdown(self, reason: str) -> None:
        self.save_checkpoint()
        if self.config.final_params:
            torch.save(self.params.clone(), self.config.final_params)
        emit("stopped", round=self.round, reason=reason)
        self.averager.shutdown()
        self.dht.shutdown()

    # ---- one round -------------------------------------------------------------------------

    def run_round(self) -> None:
        start = time.perf_counter()
        base = self.params.clone()
        self.learner.load_params(base)
        stats = self.learner.run_round(self.inner_steps, self.should_stop, lambda _: None)
        if stats.num_steps < self.inner_steps:
            return  # interrupted mid-round
        inner_s = time.perf_counter() - start
        with self.averager.get_tensors() as tensors:
            tensors[0].copy_(base - self.learner.params_vector())
        group_size, committed, behind = self._all_reduce()
        if committed:
            self._apply_mean()
        self.lost_in_a_row = 0 if committed else self.lost_in_a_row + 1
        wait_s = time.perf_counter() - start - inner_s
        emit(
            "round_done",
            round=self.round,
            inner_s=round(inner_s, 4),
            wait_s=round(wait_s, 4),
            round_s=round(time.perf_counter() - start, 4),
            committed=committed,
            group_size=group_size,
            loss=round(stats.loss, 5),
        )
        if not committed:
            self.catch_up(wait_for_barrier=behind)
        elif self.round % 10 == 0:
            self.save_checkpoint()

    def _all_reduce(self) -> tuple[int, bool, bool]:
        """(group size, whether the round commits, whether this worker is behind the others).

        A round commits when at least two workers averaged it and all were at the same round.
        """
        c = self.config
        if self._swarm_round() > self.round:
            return 0, False, True  # fell behind (frozen or restarted): this round is stale
        try:
            gathered = self.averager.step(
                gather=self.round,
                timeout=c.matchmaking_s + c.allreduce_timeout_s + 5,
                allow_retries=False,
            )
        except Exception as exc:  # the all-reduce failed: a peer died or froze mid-way
            logger.info("round %d all-reduce failed: %s", self.round, exc)
            return 0, False, False
        rounds = list((gathered or {}).values())
        committed = len(rounds) >= 2 and all(r == self.round for r in rounds)
        return len(rounds), committed, max(rounds, default=self.round) > self.round

    def _apply_mean(self) -> None:
        with self.averager.get_tensors() as tensors:
            mean = tensors[0].clone()
        with self.lock:
            self.outer.step(self.params, mean, 1.0)
            self.round += 1
        key = f"{self.config.run_id}_{self.config.mode}_round"
        expiration = get_dht_time() + 120
        self.dht.store(key, self.round, expiration, subkey=self.config.rank, return_future=True)

    def _swarm_round(self) -> int:
        """The highest round any worker has announced committing (-1 if unknown)."""
        key = f"{self.config.run_id}_{self.config.mode}_round"
        try:
            found = self.dht.get(key, latest=True)
        except Exception:  # a slow DHT must not stop the round
            return -1
        if found is None or not isinstance(found.value, dict):
            return -1
        rounds = [item.value for item in found.value.values() if isinstance(item.value, int)]
        return max(rounds, default=-1)

    def catch_up(self, *, wait_for_barrier: bool) -> None:
        """Adopt the newest state a peer serves (after a lost round or a restart).

        A worker that is behind while the others train waits for their next barrier and starts
        the following round with them: joining mid-round would leave it a round behind forever.
        """
        self._load_state()
        if not wait_for_barrier:
            return
        target = self.round
        deadline = time.monotonic() + BARRIER_WAIT_S
        while not self.stop.is_set() and time.monotonic() < deadline:
            if self._swarm_round() > target:
                self._load_state()
                return
            time.sleep(0.2)

    def _load_state(self) -> None:
        try:
            loaded = self.averager.load_state_from_peers(timeout=10)
        except Exception as exc:
            logger.info("state download failed: %s", exc)
            return
        if loaded is None:
            return
        metadata, (params, buf) = loaded
        if int(metadata["round"]) < self.round:
            return
        outer = {"kind": self.outer.kind, "buf": buf, "count": int(metadata["count"])}
        with self.lock:
            self.params.copy_(params)
            self.outer.load_state_dict(outer)
            self.round = int(metadata["round"])
        emit("state_loaded", round=self.round)

    # ---- checkpoints -----------------------------------------------------------------------

    def save_checkpoint(self) -> None:
        self.checkpoint_path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock:
            state = {
                "round": self.round,
                "params": self.params.clone(),
                "outer": self.outer.state_dict(),
                "learner": self.learner.state_dict(),
            }
        tmp = self.checkpoint_path.with_suffix(".tmp")
        torch.save(state, tmp)
        tmp.replace(self.checkpoint_path)
        emit("checkpoint_saved", round=self.round)

    def _resume(self) -> None:
        if not self.checkpoint_path.exists():
            return
        state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=True)
        self.params.copy_(state["params"])
        self.outer.load_state_dict(state["outer"])
        self.learner.load_state_dict(state["learner"])
        self.round = int(state["round"])
        emit("resumed", round=self.round)


_emit_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    line = json.dumps({"event": event, "time": round(time.time(), 3), **fields})
    with _emit_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_config_arguments(parser, WorkerConfig)
    config = config_from_args(WorkerConfig, parser.parse_args())
    if config.mode not in ("diloco", "dp"):
        parser.error("--mode must be diloco or dp")
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    worker = SyncWorker(config)
    signal.signal(signal.SIGINT, lambda *_: worker.stop.set())
    signal.signal(signal.SIGTERM, lambda *_: worker.stop.set())
    worker.start()
    reason = worker.run()
    worker.shutdown(reason)


if __name__ == "__main__":
    main()
