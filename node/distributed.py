"""A multi-GPU node: the inner loop on torch.distributed, rank 0 alone in the swarm.

`diloco-node join --nproc-per-node N` starts N ranks of itself with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, ...; plain `torchrun --nproc-per-node N -m node join ...`
works the same). Every rank then trains one
model together, DDP (a full copy per rank) or FSDP2 (`--parallel fsdp`, parameters sharded
for models that do not fit one device), so the node publishes one pseudo-gradient per round
as if it were one big device. Rank 0 runs the ordinary Node (swarm, replica, checkpoints);
its learner is a ShardedLearner that tells the other ranks what to do next with a small
command broadcast; the others run `follow` and never touch the network.

Launching the ranks and joining their process group is node.ranks.

torch.distributed's tensor, checkpoint and fsdp modules are imported where a rank uses them:
together they take ~2 s to import, which no single-device node should pay.

Every rank draws the node's global batch from the same seeded sampler and keeps its own
rows, so the global batch (and the sampler state in rank 0's checkpoint) is exactly that of
a single-process node with the same --batch-size.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from node.data import ShardSampler
from node.learner import InnerConfig, Learner, RoundStats, StepStats, _next_step_overruns

PARALLEL_CHOICES = ("ddp", "fsdp")
# Commands rank 0 broadcasts to the other ranks: (command, argument).
_STOP, _LOAD, _ROUND, _GATHER, _EVAL, _STATE, _LOAD_STATE = range(7)
# Rank 0's verdict before each inner step.
_GO, _STOPPED, _OUT_OF_TIME = range(3)


class RankSlice:
    """A sampler that draws the node's whole batch and yields this rank's rows of it."""

    def __init__(self, sampler: ShardSampler, rank: int, world_size: int) -> None:
        self.sampler = sampler
        self.rank = rank
        self.world_size = world_size

    def next_batch(self) -> tuple[Tensor, Tensor]:
        x, y = self.sampler.next_batch()
        rows = x.size(0) // self.world_size
        if rows * self.world_size != x.size(0):
            raise ValueError(
                f"--batch-size {x.size(0)} must be divisible by --nproc-per-node {self.world_size}"
            )
        mine = slice(self.rank * rows, (self.rank + 1) * rows)
        return x[mine], y[mine]

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.sampler.load_state_dict(state)


class ShardedLearner(Learner):
    """One rank's learner: the model under DDP or FSDP2, gradients averaged over the ranks.

    On rank 0 every public method first broadcasts its command, so the other ranks, waiting
    in `follow`, make the same collective calls in the same order.
    """

    def __init__(
        self,
        model: nn.Module,
        sampler: ShardSampler,
        config: InnerConfig,
        device: torch.device,
        *,
        parallel: str = "ddp",
    ) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.sharded = parallel == "fsdp"
        # NCCL moves only device tensors, gloo only CPU ones.
        self._comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.module = model.to(device)
        if self.sharded:
            _fully_shard(self.module, device)
        rows = RankSlice(sampler, self.rank, self.world_size)
        super().__init__(self.module, rows, config, device)  # type: ignore[arg-type]
        # self.model stays the plain module (its parameter names are a single process's);
        # only the inner step runs through DDP, which averages the gradients.
        self._ddp: nn.Module | None = None
        if not self.sharded:
            self._ddp = nn.parallel.DistributedDataParallel(
                self.module,
                device_ids=[device.index] if device.type == "cuda" else None,
                forward_sync_buffers=False,  # buffers are constants (rotary tables)
            )

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """torch's own AdamW (same math and state as node.inner_optim's): FSDP's optimizer
        state dict helpers need a torch.optim.Optimizer."""
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=self.config.lr,
            weight_decay=self.config.weight_decay,
            betas=(0.9, 0.95),
            fused=self.device.type == "cuda",
        )

    @property
    def _torch_optimizer(self) -> torch.optim.Optimizer:
        return cast(torch.optim.Optimizer, self.optimizer)  # built by _build_optimizer

    # ---- what rank 0 asks, everyone does ---------------------------------------------------

    def load_params(self, flat: Tensor) -> None:
        self._command(_LOAD)
        flat = self._broadcast_tensor(flat)
        if not self.sharded:
            super().load_params(flat.to(self.device))
            return
        from torch.distributed.tensor import DTensor, distribute_tensor

        offset = 0
        with torch.no_grad():
            for param in self.module.parameters():
                shard = cast(DTensor, param)  # fully_shard made every parameter a DTensor
                full = flat[offset : offset + param.numel()].view(param.shape).to(self.device)
                param.copy_(distribute_tensor(full, shard.device_mesh, shard.placements))
                offset += param.numel()

    def run_round(
        self,
        num_steps: int,
        should_stop: Callable[[], bool],
        on_step: Callable[[StepStats], None],
        max_seconds: float | None = None,
    ) -> RoundStats:
        """Rank 0 decides before each step, for every rank: go on, stop (interrupted), or
        end the round because the next step would overrun --round-time."""
        self._command(_ROUND, num_steps)
        started, steps = time.perf_counter(), [0]

        def verdict() -> int:
            if should_stop():
                return _STOPPED
            spent_s = time.perf_counter() - started
            return _OUT_OF_TIME if _next_step_overruns(max_seconds, spent_s, steps[0]) else _GO

        def counted(step: StepStats) -> None:
            steps[0] += 1
            on_step(step)

        agreed = self._agreed(verdict)
        last = [_GO]

        def stop() -> bool:
            last[0] = agreed()
            return last[0] != _GO

        stats = super().run_round(num_steps, stop, counted)
        return replace(stats, stopped_early=False) if last[0] == _OUT_OF_TIME else stats

    def params_vector(self) -> Tensor:
        if not self.sharded:
            return super().params_vector()  # every rank holds the same full parameters
        self._command(_GATHER)
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            shards = [cast(DTensor, p) for p in self.module.parameters()]
            full = [shard.full_tensor().reshape(-1) for shard in shards]
            return torch.cat(full).float().cpu()

    def evaluate(self, batches: list[tuple[Tensor, Tensor]]) -> float:
        if not self.sharded:
            return super().evaluate(batches)  # rank 0 alone: no collective
        self._command(_EVAL)
        box = [batches]
        dist.broadcast_object_list(box, src=0)
        loss = super().evaluate(box[0])
        self.module.reshard()  # type: ignore[operator]  # FSDP keeps the root gathered after forward
        return loss

    def state_dict(self) -> dict[str, Any]:
        if not self.sharded:
            return super().state_dict()
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        self._command(_STATE)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optimizer = get_optimizer_state_dict(self.module, self._torch_optimizer, options=options)
        return {**super().state_dict(), "optimizer": optimizer, "parallel": "fsdp"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._command(_LOAD_STATE)
        box: list[dict[str, Any] | None] = [state if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        assert box[0] is not None
        state = box[0]
        if not self.sharded:
            super().load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(
            self.module, self._torch_optimizer, optim_state_dict=state["optimizer"], options=options
        )
        self.step = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])

    def release(self) -> None:
        """Rank 0: let the other ranks exit; then leave the process group."""
        self._command(_STOP)
        _leave_group()

    # ---- plumbing --------------------------------------------------------------------------

    def _inner_step(self) -> tuple[float, int]:
        if self._ddp is not None:
            self.model = self._ddp
        try:
            loss, tokens = super()._inner_step()
        finally:
            self.model = self.module
        return loss, tokens * self.world_size  # the node trained on every rank's rows

    def _command(self, command: int, argument: int = 0) -> None:
        if self.rank == 0:
            dist.broadcast(torch.tensor([command, argument], device=self._comm), src=0)

    def receive_command(self) -> tuple[int, int]:
        box = torch.zeros(2, dtype=torch.int64, device=self._comm)
        dist.broadcast(box, src=0)
        return int(box[0]), int(box[1])

    def _broadcast_tensor(self, flat: Tensor) -> Tensor:
        size = torch.tensor([flat.numel() if self.rank == 0 else 0], device=self._comm)
        dist.broadcast(size, src=0)
        buffer = (
            flat.to(self._comm, torch.float32).contiguous()
            if self.rank == 0
            else torch.empty(int(size.item()), dtype=torch.float32, device=self._comm)
        )
        dist.broadcast(buffer, src=0)
        return buffer

    def _agreed(self, verdict: Callable[[], int]) -> Callable[[], int]:
        """Rank 0's verdict, broadcast: every rank takes the same number of steps."""

        def agreed() -> int:
            flag = torch.tensor([verdict() if self.rank == 0 else 0], device=self._comm)
            dist.broadcast(flag, src=0)
            return int(flag.item())

        return agreed


def _leave_group() -> None:
    """Every rank leaves together: a rank that tore down its gloo pairs while another still
    read the stop command aborted that rank ("terminate called without an active exception")."""
    dist.barrier()
    dist.destroy_process_group()


def follow(learner: ShardedLearner) -> None:
    """Ranks > 0: do what rank 0 asks until it says stop (or its process group goes away)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # rank 0 decides when the node stops
    handlers: dict[int, Callable[[int], object]] = {
        _LOAD: lambda _: learner.load_params(torch.empty(0)),
        _ROUND: lambda steps: learner.run_round(steps, lambda: False, lambda _: None, None),
        _GATHER: lambda _: learner.params_vector(),
        _EVAL: lambda _: learner.evaluate([]),
        _STATE: lambda _: learner.state_dict(),
        _LOAD_STATE: lambda _: learner.load_state_dict({}),
    }
    while True:
        command, argument = learner.receive_command()
        if command == _STOP:
            _leave_group()
            return
        handlers[command](argument)


def _fully_shard(model: nn.Module, device: torch.device) -> None:
    """FSDP2: each transformer block its own unit, then the rest (embeddings, head) at the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):  # the blocks of the built-in GPT and of hf: models
            for block in module:
                fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
