"""Starting a multi-GPU node's ranks: where this process sits in a torchrun launch, the
launch of N local ranks by `join --nproc-per-node N`, and joining their process group.

What the ranks then do together (the sharded inner loop, rank 0's commands to the others)
is node.distributed; node.multigpu composes each rank.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_leader(self) -> bool:
        return self.rank == 0


def torchrun_rank() -> RankInfo | None:
    """This process's place in a torchrun launch, None outside one (or with a single rank)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1 or "LOCAL_RANK" not in os.environ:
        return None
    return RankInfo(
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        local_rank=int(os.environ["LOCAL_RANK"]),
    )


def launch_local_ranks(nproc_per_node: int, argv: Sequence[str]) -> int:
    """Run `python -m node ARGV` as N ranks on this machine, with torchrun's environment.

    Ctrl+C or SIGTERM reaches rank 0 as SIGTERM (a terminal's Ctrl+C also reaches it
    directly; SIGTERM after SIGINT is still a clean stop), which stops the node cleanly and
    releases the others. If a rank fails, the others are ended; the exit code is rank 0's.
    """
    env = os.environ | {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": str(nproc_per_node),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
    }
    ranks = [
        subprocess.Popen(
            [sys.executable, "-m", "node", *argv],
            env=env | {"RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(nproc_per_node)
    ]

    def stop_rank_zero(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            ranks[0].send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop_rank_zero) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        _wait_for_ranks(ranks)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return ranks[0].returncode


def _wait_for_ranks(ranks: list[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    """Until every rank has exited; once rank 0 is gone or any rank failed, `grace_s` more."""
    deadline: float | None = None
    while any(proc.poll() is None for proc in ranks):
        codes = [proc.poll() for proc in ranks]
        if deadline is None and (codes[0] is not None or any(c for c in codes if c)):
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            logger.error("ranks %s did not exit after rank 0 did; ending them", codes)
            return
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def init_ranks(rank: RankInfo, device_name: str) -> torch.device:
    """Join the process group (NCCL on CUDA, gloo on CPU); the device this rank trains on."""
    use_cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if use_cuda:
        torch.cuda.set_device(rank.local_rank)
    # Ranks > 0 wait in a broadcast while rank 0 joins the swarm, merges or lingers; if rank 0
    # dies, torchrun ends the others, so the wait needs no short timeout.
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(days=1))
    return torch.device("cuda", rank.local_rank) if use_cuda else torch.device("cpu")
