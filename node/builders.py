"""The parts of a node, each built by one small function from the settings sections it reads.

node/app.py calls these in order. A builder takes sections by type (`TrainSettings`,
`NetworkSettings`, or `RunSettings` for the run-level three); a section builds the component
config it stands for (node/settings.py), and a builder composes them. A hook that changes how
one part is made (a distributed learner, another codec, a tracker) changes one builder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import psutil
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from dht.addresses import listen_maddrs
from dht.swarm_config import SwarmConfig
from merge.fragments import FragmentLayout
from merge.outer import make_outer_optimizer
from merge.pipeline import MergeConfig
from merge.replica import Replica
from node.config import run_fingerprint
from node.data import Corpus, ShardSampler, Split, data_slice, validation_batches
from node.distributed import ShardedLearner
from node.evaluation import BackgroundEvaluation
from node.learner import InnerConfig, Learner
from node.model import DEFAULT_BATCH_SIZE, DEFAULT_INNER_LR, ModelConfig, model_config
from node.settings import NetworkSettings, RunSettings, TrainSettings


@dataclass(frozen=True)
class RunSpec:
    """What every node of a run must agree on, and the fingerprint that hashes it."""

    model: ModelConfig
    merge: MergeConfig
    batch_size: int
    fingerprint: str

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.model.block_size


@dataclass(frozen=True)
class HostFacts:
    """What a heartbeat says about this machine; read once, not on every heartbeat."""

    version: str
    device: str
    memory_gb: float


def build_merge_config(run: RunSettings, tokens_per_step: int) -> MergeConfig:
    """How this run weighs and applies updates: its sections' pieces, bounded by H and the
    tokens of one inner step."""
    return MergeConfig(
        outer=run.outer_config(run.codec),
        staleness=run.staleness_config(),
        token_weight=run.token_weight_config(run.inner_steps * tokens_per_step),
        max_inner_steps=run.inner_steps,
        max_tokens_per_step=tokens_per_step,
        correction=run.correction_config(),
    )


def fingerprint_spec(run: RunSettings, model: ModelConfig, merge: MergeConfig) -> dict[str, Any]:
    """The run-level settings the fingerprint hashes."""
    spec: dict[str, Any] = {
        "run_id": run.run_id,
        "seed": run.seed,
        "model": model.as_dict(),
        "merge": merge.as_dict(),
    }
    if run.fragments > 1:  # absent at P = 1: fingerprints from before fragments hold
        spec["fragments"] = run.fragments
    if run.groups_on:  # absent while groups are off: fingerprints from before groups hold
        spec["groups"] = run.groups_spec()
    return spec


def build_run_spec(run: RunSettings, corpus: Corpus) -> RunSpec:
    model = model_config(run.model, corpus.vocab_size)
    batch_size = run.batch_size or DEFAULT_BATCH_SIZE[run.model]
    merge = build_merge_config(run, batch_size * model.block_size)
    fingerprint = run_fingerprint(fingerprint_spec(run, model, merge))
    return RunSpec(model=model, merge=merge, batch_size=batch_size, fingerprint=fingerprint)


def configure_torch(train: TrainSettings) -> None:
    if train.threads:
        torch.set_num_threads(train.threads)


def build_replica(model: nn.Module, merge: MergeConfig, fragments: int = 1) -> Replica:
    """The global model at genesis, with its outer optimizer (one per fragment with P > 1)."""
    genesis = parameters_to_vector(model.parameters()).detach().float().clone()
    if fragments == 1:
        return Replica(genesis, make_outer_optimizer(merge.outer, genesis.numel()))
    layout = FragmentLayout([p.numel() for p in model.parameters()], fragments)
    outers = [
        make_outer_optimizer(merge.outer, layout.fragment_numel(p))
        for p in range(layout.num_fragments)
    ]
    return Replica(genesis, outers, layout)


def inner_config(train: TrainSettings) -> InnerConfig:
    """The inner loop: the train section, with the model preset's learning rate by default."""
    max_steps = (train.max_rounds or 0) * train.inner_steps
    return InnerConfig(
        lr=train.inner_lr or DEFAULT_INNER_LR[train.model],
        weight_decay=train.weight_decay,
        grad_clip=train.grad_clip,
        warmup_steps=train.warmup_steps,
        decay_steps=train.lr_decay_steps or max_steps or 100_000,
        speed_factor=train.speed_factor,
        emulated_step_s=train.emulated_step_s,
    )


def build_learner(
    train: TrainSettings,
    spec: RunSpec,
    model: nn.Module,
    split: Split,
    peer_id: str,
    device: torch.device,
) -> Learner:
    sampler = ShardSampler(
        data_slice(split.train, train.data_slice),
        seed=f"{train.run_id}/{peer_id}",
        batch_size=spec.batch_size,
        block_size=spec.model.block_size,
    )
    if torch.distributed.is_initialized():  # a rank of a multi-GPU node (node.distributed)
        return ShardedLearner(model, sampler, inner_config(train), device, parallel=train.parallel)
    return Learner(model, sampler, inner_config(train), device)


def build_validation(
    train: TrainSettings, spec: RunSpec, split: Split
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if not train.eval_batches:
        return []
    return validation_batches(
        split.val,
        batch_size=spec.batch_size,
        block_size=spec.model.block_size,
        num_batches=train.eval_batches,
    )


def build_evaluation(
    learner: Learner,
    val_batches: list[tuple[torch.Tensor, torch.Tensor]],
    report: Callable[[int, float], None],
) -> BackgroundEvaluation | None:
    """Evaluation beside training, on snapshots. None without validation batches, or for a
    sharded learner: its evaluation is a collective of all ranks, which must not interleave
    with the training steps' (the Trainer evaluates inline then)."""
    if not val_batches or getattr(learner, "sharded", False):
        return None
    return BackgroundEvaluation(learner.model, val_batches, learner.device, report)


def build_swarm_config(
    run: RunSettings,
    network: NetworkSettings,
    spec: RunSpec,
    num_params: int,
    port: int | None = None,
    settings: dict[str, Any] | None = None,
) -> SwarmConfig:
    """The network section, with the run's summary and bounds. `port`: the one preflight
    settled on (default: --port); `settings`: the run's non-default fingerprint settings
    (node.fingerprint), published for refused nodes."""
    summary: dict[str, Any] = {"model": run.model, **spec.model.as_dict(), "seed": run.seed}
    summary |= {"inner_steps": run.inner_steps, "outer": run.outer_optimizer}
    if settings is not None:
        summary["settings"] = settings
    return SwarmConfig(
        run_id=run.run_id,
        fingerprint=spec.fingerprint,
        run_summary=summary,
        identity_path=str(network.identity_path),
        initial_peers=list(network.peers or []),
        host_maddrs=listen_maddrs(network.host, network.listen_port if port is None else port),
        announce_maddrs=list(network.announce or []),
        use_relay=network.relay,
        use_auto_relay=network.auto_relay,
        relay_limits=network.relay_limits,
        client_mode=network.client_mode,
        serve_state=network.serve_state,
        heartbeat_period_s=network.heartbeat_period,
        # A round of P fragments is P updates of 1/P the size: the same rounds, the same bytes.
        retain_updates=network.retain_updates * run.fragments,
        gap_wait_s=network.gap_wait,
        retain_bytes=int(network.retain_mb * 1e6),
        max_update_bytes=4 * num_params + (1 << 16),
        max_state_bytes=16 * num_params + (64 << 20),
    )


def host_facts(device: torch.device) -> HostFacts:
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        memory = psutil.virtual_memory().total
    return HostFacts(
        version=package_version(), device=str(device), memory_gb=round(memory / 2**30, 1)
    )


def package_version() -> str:
    try:
        return version("diloco-node")
    except PackageNotFoundError:
        return "0+unknown"
