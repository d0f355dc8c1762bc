"""`join --nproc-per-node N` and torchrun launches: rank 0 runs the Node, the others follow.

The ranks' inner loop lives in node.distributed, their launch in node.ranks; this module
composes each.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

import torch
import torch.distributed as dist

from merge.identity import Identity
from node.app import build_events, compose_follower
from node.config import JoinConfig
from node.distributed import ShardedLearner, follow
from node.events import configure_logging
from node.model import DEFAULT_BATCH_SIZE
from node.ranks import RankInfo, init_ranks, launch_local_ranks, torchrun_rank
from node.runtime import Node
from node.signals import stop_on_signals


def run_multiprocess_join(config: JoinConfig, argv: Sequence[str]) -> int:
    """`join --nproc-per-node N`: start the ranks; as one of them (or under torchrun): train."""
    rank = torchrun_rank()
    if rank is None:
        batch_size = config.batch_size or DEFAULT_BATCH_SIZE[config.model]
        if batch_size % config.nproc_per_node:
            raise ValueError(
                f"the node's batch of {batch_size} sequences does not split over "
                f"--nproc-per-node {config.nproc_per_node}; pass a --batch-size divisible by it"
            )
        _check_devices(config.device, config.nproc_per_node)
        return launch_local_ranks(config.nproc_per_node, argv)
    return run_ranked_join(config, rank)


def _check_devices(device: str, nproc_per_node: int) -> None:
    """One GPU per rank: more ranks than GPUs is a clear error, not a CUDA one later."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and nproc_per_node > torch.cuda.device_count():
        raise ValueError(
            f"--nproc-per-node {nproc_per_node} needs as many GPUs; "
            f"this machine has {torch.cuda.device_count()}"
        )


def run_ranked_join(config: JoinConfig, rank: RankInfo) -> int:
    """One rank of a multi-GPU node: rank 0 runs the Node, the others follow it."""
    device = init_ranks(rank, config.device)
    if not rank.is_leader:
        configure_logging("WARNING", "rich")
        follow(compose_follower(config, _shared_peer_id(config, rank), device))
        _exit_follower()
    configure_logging(config.log_level, config.log_format)
    _shared_peer_id(config, rank)
    events = build_events(config)
    try:
        node = Node(config, events)
        assert isinstance(node.learner, ShardedLearner)
        try:
            with stop_on_signals(node.request_stop):
                node.run()
        finally:
            with contextlib.suppress(Exception):  # a rank that died has closed the group
                node.learner.release()
    finally:
        events.close()
    return 0


def _exit_follower() -> NoReturn:
    """A follower that left the process group with every rank (node.distributed._leave_group)
    exits at once, skipping the interpreter's teardown: its DDP or FSDP module still holds the
    gloo group, whose worker threads torn down during finalization can abort the process
    ("terminate called without an active exception", a rank of tests/node/test_distributed.py
    in CI, session 17). Rank 0 saves and reports everything; a follower has nothing to flush
    but its console."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _shared_peer_id(config: JoinConfig, rank: RankInfo) -> str:
    """Rank 0's peer id, which seeds the node's data shard on every rank."""
    box: list[str | None] = [None]
    if rank.is_leader:
        box[0] = Identity.load_or_create(config.identity_path)[0].peer_id
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]
