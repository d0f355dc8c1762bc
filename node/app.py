"""The composition root: where a node's collaborators are built and wired together.

`compose` builds, in order: the identity and checkpoint locks, the identity, data, model,
replica and pipeline, the learner, the dashboard, the swarm (the network's, or an
`OfflineSwarm` with --no-swarm), telemetry, publishing, persistence and the Trainer. Nothing
else in node/ constructs collaborators; `node.runtime.Node` runs what is built here. The
dashboard is built through node.dashboard_seam, node/'s one module that imports dashboard/.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dht.grouping import member_check
from dht.heartbeat import Heartbeat
from dht.known_peers import join_peers, remember_peers
from merge.allowlist import AllowList
from merge.codec_policy import start_codec
from merge.codecs import get_codec
from merge.identity import Identity
from merge.pipeline import UpdatePipeline
from merge.replica import Replica
from node.builders import (
    RunSpec,
    build_evaluation,
    build_learner,
    build_replica,
    build_run_spec,
    build_swarm_config,
    build_validation,
    configure_torch,
    host_facts,
)
from node.config import JoinConfig
from node.dashboard_seam import NodeDashboard, build_dashboard
from node.data import Corpus, load_corpus, split_corpus
from node.distributed import ShardedLearner
from node.events import EventLog, make_event_log
from node.fingerprint import fingerprint_settings
from node.fragment_publishing import FragmentStreams
from node.group_publishing import GroupPublishing
from node.learner import Learner, resolve_device
from node.lifecycle import adopt_legacy_checkpoint, has_checkpoint, preflight
from node.local_nodes import ControlFileEvents
from node.locks import ResourceLock, checkpoint_lock, lock_identity
from node.model import build_model
from node.persistence import Persistence
from node.publishing import Publisher, RoundPublishing, WholeUpdates, auto_codec
from node.round_size import RoundSizeConfig, RoundSizer
from node.seq_ledger import SeqLedger
from node.stats import NodeStats
from node.swarm_link import OfflineSwarm, SwarmLink
from node.swarm_start import StartingSwarm
from node.telemetry import Telemetry
from node.tracking import tracked
from node.trainer import Trainer

if TYPE_CHECKING:  # hivemind: imported beside training (node.swarm_start)
    from dht.swarm import Swarm
    from node.network_swarm import NetworkSwarm

logger = logging.getLogger(__name__)

__all__ = ["NodeParts", "build_events", "compose", "compose_follower"]


@dataclass
class NodeParts:
    """Everything a node is made of, built and wired by `compose`."""

    config: JoinConfig
    locks: list[ResourceLock]
    identity: Identity
    checkpoint_dir: Path
    moved_checkpoint: Path | None
    device: torch.device
    corpus: Corpus
    spec: RunSpec
    seq_ledger: SeqLedger
    run_settings: dict[str, Any]
    replica: Replica
    pipeline: UpdatePipeline
    learner: Learner
    stats: NodeStats
    events: EventLog
    dashboard: NodeDashboard | None
    """Built and served beside training; until then it keeps the events it will show."""
    swarm: SwarmLink
    """The network's (a StartingSwarm), or an OfflineSwarm with --no-swarm."""
    telemetry: Telemetry
    publisher: Publisher
    publishing: RoundPublishing
    persistence: Persistence
    trainer: Trainer

    @property
    def network(self) -> Swarm | None:
        """The network's swarm once built (None with --no-swarm, or before it is built)."""
        return self.swarm.network if isinstance(self.swarm, StartingSwarm) else None

    def release(self) -> None:
        """Release the identity and checkpoint dir for another node."""
        for lock in reversed(self.locks):
            lock.release()


def compose(config: JoinConfig, events: EventLog) -> NodeParts:
    """Build a node from its settings; the locks taken are released again if that fails."""
    identity_path, held = lock_identity(config.identity_path, is_default=config.identity is None)
    locks = [held]
    try:
        return _compose(_with_identity(config, identity_path), events, locks)
    except BaseException:
        for lock in reversed(locks):
            lock.release()
        raise


def _with_identity(config: JoinConfig, identity_path: Path) -> JoinConfig:
    if identity_path == config.identity_path:
        return config
    logger.warning(
        "identity %s is in use by another node on this machine; this node runs as %s",
        config.identity_path,
        identity_path,
    )
    return replace(config, identity=str(identity_path))


def _compose(config: JoinConfig, events: EventLog, locks: list[ResourceLock]) -> NodeParts:
    identity, _ = Identity.load_or_create(config.identity_path)
    peer_id = identity.peer_id
    checkpoint_dir = config.checkpoint_path(peer_id)
    locks.append(checkpoint_lock(checkpoint_dir).acquire())
    moved_checkpoint = adopt_legacy_checkpoint(config, peer_id)
    events.emit("startup_phase", name="identity_and_locks")
    device = resolve_device(config.device)
    configure_torch(config)
    corpus = load_corpus(config.data)
    split = split_corpus(corpus)
    spec = build_run_spec(config, corpus)
    # Beside the identity (held under its lock): the seqs it sealed, per run.
    seqs_path = config.identity_path.with_name(config.identity_path.name + ".seqs")
    seq_ledger = SeqLedger(seqs_path, spec.fingerprint)
    run_settings = fingerprint_settings(config, corpus)
    model = build_model(spec.model, config.seed)
    replica = build_replica(model, spec.merge, config.fragments)
    pipeline = UpdatePipeline(replica, spec.merge, spec.fingerprint)
    learner = build_learner(config, spec, model, split, peer_id, device)
    stats = NodeStats()
    # Measured and reported always (peers may size by it); sizes rounds with --dynamic-h.
    round_sizer = RoundSizer(RoundSizeConfig(max_steps=config.inner_steps))
    # The dashboard and the swarm call the telemetry back once started, after it is built.
    dashboard = build_dashboard(config, peer_id, lambda: telemetry.status())
    if dashboard is not None:
        events = dashboard.tee(events)
    if config.swarm:  # `status` without --peers finds it through its control file
        events = ControlFileEvents(events, config.run_id)
    allowlist = AllowList.load(config.allow_keys) if config.allow_keys else None
    if allowlist is not None:  # a permissioned run: only listed keys contribute
        pipeline.admit = allowlist.allows
    swarm: SwarmLink = OfflineSwarm()
    if config.swarm:
        swarm = StartingSwarm(
            lambda: _build_network(
                config, spec, identity, checkpoint_dir, replica, pipeline, stats, events,
                run_settings, allowlist, telemetry,
                publishing.announced if isinstance(publishing, GroupPublishing) else None,
            )
        )  # fmt: skip
    codec = get_codec(start_codec(config.codec))  # --codec auto: bf16 until measured
    telemetry = Telemetry(
        config=config,
        peer_id=peer_id,
        fingerprint=spec.fingerprint,
        host=host_facts(device),
        codec=codec.name,
        replica=replica,
        pipeline=pipeline,
        swarm=swarm,
        stats=stats,
        round_sizer=round_sizer,
        events=events,
        facts={
            "run_id": config.run_id,
            "fingerprint": spec.fingerprint,
            "peer_id": peer_id,
            "model": config.model,
            "num_params": replica.numel,
            "device": str(device),
            "data": corpus.source,
        },
    )
    publisher = Publisher(
        identity=identity,
        fingerprint=spec.fingerprint,
        codec=codec,
        replica=replica,
        pipeline=pipeline,
        seq_ledger=seq_ledger,
        stats=stats,
        swarm=swarm,
        report_merge=telemetry.report_merge,
    )
    publishing: RoundPublishing = (
        GroupPublishing(
            publisher,
            learner,
            spec.merge,
            config,
            config.run_id,
            events,
            census_s=CENSUS_PERIODS * config.heartbeat_period,
        )
        if config.groups_on
        else WholeUpdates(
            publisher,
            learner,
            spec.merge,
            codec,
            auto_codec(config.codec, replica.numel, telemetry.codec_picked),
        )
        if replica.layout is None
        else FragmentStreams(publisher, learner, codec, config.inner_steps, stats, events)
    )
    if isinstance(publishing, GroupPublishing):  # group updates name the run they are of
        pipeline.enable_groups(config.run_id, functools.partial(member_check, config.run_id))
    persistence = Persistence(
        checkpoint_dir=checkpoint_dir,
        fingerprint=spec.fingerprint,
        model={"name": config.model, "vocab_size": spec.model.vocab_size},
        settings=run_settings,
        peer_id=peer_id,
        inner_steps=config.inner_steps,
        replica=replica,
        pipeline=pipeline,
        learner=learner,
        error_feedback=publishing.error_feedback(),
        stats=stats,
        seq_ledger=seq_ledger,
        events=events,
        replica_changed=telemetry.record_replica,
        saved=_peers_remembered(swarm, checkpoint_dir),
    )
    val_batches = build_validation(config, spec, split)
    # The evaluation thread reports to the Trainer, built next (called once training runs).
    evaluation = build_evaluation(
        learner, val_batches, lambda round_, loss: trainer.report_evaluation(round_, loss)
    )
    trainer = Trainer(
        config=config,
        learner=learner,
        replica=replica,
        val_batches=val_batches,
        evaluation=evaluation,
        publishing=publishing,
        persistence=persistence,
        telemetry=telemetry,
        swarm=swarm,
        round_sizer=round_sizer,
        stats=stats,
    )
    telemetry.record_replica()
    return NodeParts(
        config=config,
        locks=locks,
        identity=identity,
        checkpoint_dir=checkpoint_dir,
        moved_checkpoint=moved_checkpoint,
        device=device,
        corpus=corpus,
        spec=spec,
        seq_ledger=seq_ledger,
        run_settings=run_settings,
        replica=replica,
        pipeline=pipeline,
        learner=learner,
        stats=stats,
        events=events,
        dashboard=dashboard,
        swarm=swarm,
        telemetry=telemetry,
        publisher=publisher,
        publishing=publishing,
        persistence=persistence,
        trainer=trainer,
    )


CENSUS_PERIODS = 10
"""Learner groups: heartbeat periods a peer counts in the grouping's census after its last
heartbeat (node.group_publishing), against the 3 of liveness."""


def build_events(config: JoinConfig) -> EventLog:
    """A node process's event log (--log-format), tracked when --tensorboard or --wandb asks."""
    return tracked(make_event_log(config.log_format), config)


def compose_follower(config: JoinConfig, peer_id: str, device: torch.device) -> ShardedLearner:
    """A multi-GPU node's rank other than 0 (node.multigpu): the same model, sampler and
    optimizer that rank 0's `compose` builds, on this rank, and nothing else."""
    configure_torch(config)
    corpus = load_corpus(config.data)
    spec = build_run_spec(config, corpus)
    model = build_model(spec.model, config.seed)
    learner = build_learner(config, spec, model, split_corpus(corpus), peer_id, device)
    assert isinstance(learner, ShardedLearner)
    return learner


def _peers_remembered(swarm: SwarmLink, checkpoint_dir: Path) -> Callable[[], None]:
    """After each checkpoint: the live peers, tried on restart if the bootstrap is gone
    (offline, nothing: decided here, once, like every part that differs offline)."""
    if isinstance(swarm, OfflineSwarm):
        return lambda: None
    link = swarm

    def remember() -> None:
        remember_peers(checkpoint_dir, link.alive_peers())

    return remember


def _build_network(
    config: JoinConfig,
    spec: RunSpec,
    identity: Identity,
    checkpoint_dir: Path,
    replica: Replica,
    pipeline: UpdatePipeline,
    stats: NodeStats,
    events: EventLog,
    run_settings: dict[str, Any],
    allowlist: AllowList | None,
    telemetry: Telemetry,
    groups: Callable[[], tuple[int, int] | None] | None = None,
) -> NetworkSwarm:
    """The network's swarm, built beside training (node.swarm_start): hivemind's imports, the
    port, the bootstrap peers (retried with backoff, then the peers this node knew last time;
    a known member that reaches none trains and dials them in the background)."""
    from dht.swarm import Swarm  # hivemind: seconds of imports, off the training path
    from node.network_swarm import NetworkSwarm

    swarm_config = build_swarm_config(
        config, config, spec, replica.numel, preflight(config), run_settings
    )
    peers = join_peers(
        swarm_config.initial_peers, checkpoint_dir, known_member=has_checkpoint(checkpoint_dir)
    )
    swarm_config = replace(swarm_config, initial_peers=peers.now, rejoin_peers=peers.rejoin)
    network = Swarm(
        swarm_config,
        identity,
        replica,
        pipeline,
        heartbeat_fn=telemetry.heartbeat if groups is None else _grouped(telemetry, groups),
        on_merge=telemetry.report_merge,
        on_event=events.emit,
    )
    if allowlist is not None:  # shown under the file's organization
        network.membership.admit = allowlist.allows
        network.membership.org_of = allowlist.org_of
    return NetworkSwarm(
        network,
        peer_id=identity.peer_id,
        run_id=config.run_id,
        run_settings=run_settings,
        replica=replica,
        pipeline=pipeline,
        stats=stats,
        events=events,
        replica_changed=telemetry.record_replica,
        report_merge=telemetry.report_merge,
        groups=groups is not None,
    )


def _grouped(
    telemetry: Telemetry, groups: Callable[[], tuple[int, int] | None]
) -> Callable[[], Heartbeat]:
    """Heartbeats that carry the grouping this node is in (learner groups on): peers whose
    first census was partial follow it (dht.grouping_split)."""

    def heartbeat() -> Heartbeat:
        beat, grouping = telemetry.heartbeat(), groups()
        if grouping is None:
            return beat
        return replace(beat, group_bits=grouping[0], group_epoch=grouping[1])

    return heartbeat
