"""The parts of a node, each built by one small function from the JoinConfig.

`Node.__init__` calls these in order; a hook that changes how one part is made (a distributed
learner, another codec, a tracker) changes one builder, not the node.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import psutil
import torch
from torch import nn
from torch.nn.utils import parameters_to_vector

from dht.addresses import listen_maddrs
from dht.swarm import SwarmConfig
from merge.correction import CorrectionConfig
from merge.feedback import default_outer_momentum
from merge.fragments import FragmentLayout
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig
from merge.replica import Replica
from merge.weighting import StalenessConfig, TokenWeightConfig
from node.config import JoinConfig, run_fingerprint
from node.data import Corpus, ShardSampler, Split, data_slice, validation_batches
from node.distributed import ShardedLearner
from node.learner import InnerConfig, Learner
from node.model import DEFAULT_BATCH_SIZE, DEFAULT_INNER_LR, ModelConfig, model_config


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


def merge_config_from(config: JoinConfig, tokens_per_step: int) -> MergeConfig:
    return MergeConfig(
        outer=OuterConfig(
            kind=config.outer_optimizer,  # type: ignore[arg-type]
            lr=config.outer_lr,
            momentum=(
                default_outer_momentum(config.codec)
                if config.outer_momentum is None
                else config.outer_momentum
            ),
            delay=config.outer_delay,
        ),
        staleness=StalenessConfig(
            kind=config.staleness,  # type: ignore[arg-type]
            a=config.staleness_a,
            b=config.staleness_b,
        ),
        token_weight=TokenWeightConfig(
            kind=config.token_weighting,  # type: ignore[arg-type]
            reference_tokens=config.inner_steps * tokens_per_step,
        ),
        max_inner_steps=config.inner_steps,
        max_tokens_per_step=tokens_per_step,
        correction=CorrectionConfig(
            kind=config.correction,  # type: ignore[arg-type]
            strength=config.correction_strength,
        ),
    )


def fingerprint_spec(config: JoinConfig, model: ModelConfig, merge: MergeConfig) -> dict[str, Any]:
    """The run-level settings the fingerprint hashes."""
    spec: dict[str, Any] = {
        "run_id": config.run_id,
        "seed": config.seed,
        "model": model.as_dict(),
        "merge": merge.as_dict(),
    }
    if config.fragments > 1:  # absent at P = 1: fingerprints from before fragments hold
        spec["fragments"] = config.fragments
    return spec


def build_run_spec(config: JoinConfig, corpus: Corpus) -> RunSpec:
    model = model_config(config.model, corpus.vocab_size)
    batch_size = config.batch_size or DEFAULT_BATCH_SIZE[config.model]
    merge = merge_config_from(config, batch_size * model.block_size)
    fingerprint = run_fingerprint(fingerprint_spec(config, model, merge))
    return RunSpec(model=model, merge=merge, batch_size=batch_size, fingerprint=fingerprint)


def configure_torch(config: JoinConfig) -> None:
    if config.threads:
        torch.set_num_threads(config.threads)


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


def inner_config(config: JoinConfig) -> InnerConfig:
    max_steps = (config.max_rounds or 0) * config.inner_steps
    return InnerConfig(
        lr=config.inner_lr or DEFAULT_INNER_LR[config.model],
        weight_decay=config.weight_decay,
        grad_clip=config.grad_clip,
        warmup_steps=config.warmup_steps,
        decay_steps=config.lr_decay_steps or max_steps or 100_000,
        speed_factor=config.speed_factor,
        emulated_step_s=config.emulated_step_s,
    )


def build_learner(
    config: JoinConfig,
    spec: RunSpec,
    model: nn.Module,
    split: Split,
    peer_id: str,
    device: torch.device,
) -> Learner:
    sampler = ShardSampler(
        data_slice(split.train, config.data_slice),
        seed=f"{config.run_id}/{peer_id}",
        batch_size=spec.batch_size,
        block_size=spec.model.block_size,
    )
    if torch.distributed.is_initialized():  # a rank of a multi-GPU node (node.distributed)
        return ShardedLearner(
            model, sampler, inner_config(config), device, parallel=config.parallel
        )
    return Learner(model, sampler, inner_config(config), device)


def build_validation(
    config: JoinConfig, spec: RunSpec, split: Split
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if not config.eval_batches:
        return []
    return validation_batches(
        split.val,
        batch_size=spec.batch_size,
        block_size=spec.model.block_size,
        num_batches=config.eval_batches,
    )


def swarm_config_from(
    config: JoinConfig,
    spec: RunSpec,
    num_params: int,
    port: int | None = None,
    settings: dict[str, Any] | None = None,
) -> SwarmConfig:
    """`port`: the one preflight settled on (default: --port); `settings`: the run's
    non-default fingerprint settings (node.fingerprint), published for refused nodes."""
    summary: dict[str, Any] = {"model": config.model, **spec.model.as_dict(), "seed": config.seed}
    summary |= {"inner_steps": config.inner_steps, "outer": config.outer_optimizer}
    if settings is not None:
        summary["settings"] = settings
    return SwarmConfig(
        run_id=config.run_id,
        fingerprint=spec.fingerprint,
        run_summary=summary,
        identity_path=str(config.identity_path),
        initial_peers=list(config.peers or []),
        host_maddrs=listen_maddrs(config.host, config.listen_port if port is None else port),
        announce_maddrs=list(config.announce or []),
        use_relay=config.relay,
        use_auto_relay=config.auto_relay,
        relay_limits=config.relay_limits,
        client_mode=config.client_mode,
        serve_state=config.serve_state,
        heartbeat_period_s=config.heartbeat_period,
        # A round of P fragments is P updates of 1/P the size: the same rounds, the same bytes.
        retain_updates=config.retain_updates * config.fragments,
        gap_wait_s=config.gap_wait,
        retain_bytes=int(config.retain_mb * 1e6),
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
