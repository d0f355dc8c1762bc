"""Inner-loop throughput on this machine's accelerator: tokens/s, peak memory and MFU.

    python -m bench.gpu                          # small and base, bf16 autocast, fused AdamW
    python -m bench.gpu --models tiny --steps 3  # a quick check (the CPU gets MFU null)

Each model runs the node's own Learner (the inner step the node runs: autocast, AdamW fused
where available, gradient clipping) on random bytes for --warmup steps, then --steps timed
steps. MFU = achieved model FLOPs / the device's peak dense bf16 FLOPs, with 6 N + 12 L T d
FLOPs per token (PaLM's estimate: weights forward + backward, plus attention scores). On
CUDA the model is compiled (torch.compile) unless --no-compile. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import resource

import numpy as np
import torch

from node.config import model_size
from node.data import ShardSampler
from node.learner import InnerConfig, Learner, resolve_device
from node.model import DEFAULT_BATCH_SIZE, build_model, model_config

# Peak dense bf16 tensor-core FLOP/s (no sparsity), by a substring of the CUDA device name;
# more specific names first (an "H100 PCIe" also contains "H100").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("A10", 125e12),
    ("RTX 4090", 165e12),
    ("V100", 125e12),  # fp16 (V100 has no bf16 tensor cores)
)


# Sequences per step on a GPU: enough tokens per step (64 x 256, 32 x 1024) to fill an
# H100-class device; a node's own default batch is smaller (--batch-size).
GPU_BATCH_SIZE = {"small": 64, "base": 32}


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(peak bf16 FLOP/s, its source) of `device`; (None, why) when it is not known."""
    if device.type != "cuda":
        return None, "no peak FLOP/s table for CPUs: MFU is a GPU figure"
    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(name: str) -> tuple[float | None, str]:
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops, f"{name}: {flops / 1e12:.0f} TFLOP/s dense bf16 ({key})"
    return None, f"{name} is not in bench.gpu's peak FLOP/s table"


def flops_per_token(model: torch.nn.Module, n_layer: int, n_embd: int, seq_len: int) -> float:
    num_params = sum(p.numel() for p in model.parameters())
    return 6 * num_params + 12 * n_layer * n_embd * seq_len


def run(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, object]:
    config = model_config(name)
    model = build_model(config, seed=0)
    batch_size = args.batch_size or (
        GPU_BATCH_SIZE.get(model_size(name), DEFAULT_BATCH_SIZE[name])
        if device.type == "cuda"
        else 1
    )
    tokens = np.random.default_rng(0).integers(0, 256, 1 << 22).astype(np.uint16)
    sampler = ShardSampler(tokens, seed="bench", batch_size=batch_size, block_size=args.seq_len)
    inner = InnerConfig(lr=1e-4, weight_decay=0.1, grad_clip=1.0, warmup_steps=1, decay_steps=10)
    learner = Learner(model, sampler, inner, device)
    if args.compile:
        learner.model = torch.compile(learner.model)  # type: ignore[assignment]
    learner.run_round(args.warmup, lambda: False, lambda _: None)  # compile, allocator, cuDNN
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    stats = learner.run_round(args.steps, lambda: False, lambda _: None)
    tokens_per_s = stats.tokens / stats.compute_s
    peak, _ = peak_flops(device)
    achieved = tokens_per_s * flops_per_token(model, config.n_layer, config.n_embd, args.seq_len)
    return {
        "model": name,
        "num_params": sum(p.numel() for p in model.parameters()),
        "batch_size": batch_size,
        "seq_len": args.seq_len,
        "steps": stats.num_steps,
        "step_ms": round(1e3 * stats.compute_s / stats.num_steps, 2),
        "tokens_per_s": round(tokens_per_s, 1),
        "tflops": round(achieved / 1e12, 3),
        "mfu": round(achieved / peak, 4) if peak else None,
        "peak_memory_gb": round(_peak_memory(device) / 2**30, 3),
        "loss": round(stats.loss, 4),
    }


def _peak_memory(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # process RSS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="small,base", help="comma-separated model names")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (GPU 30, CPU 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (GPU 5, CPU 1)")
    parser.add_argument(
        "--batch-size", type=int, default=None, help="default: GPU 64 (small), 32 (base); CPU 1"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="default: the model's context")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the model (default: on CUDA)",
    )
    args = parser.parse_args()
    device = resolve_device(args.device)
    on_gpu = device.type == "cuda"
    args.steps = args.steps or (30 if on_gpu else 2)
    args.warmup = args.warmup if args.warmup is not None else (5 if on_gpu else 1)
    args.compile = on_gpu if args.compile is None else args.compile
    peak, peak_source = peak_flops(device)
    print(f"device: {device} ({peak_source}); compile: {args.compile}; bf16 autocast: {on_gpu}")
    results = []
    for name in args.models.split(","):
        seq_len = args.seq_len or model_config(name).block_size
        row = run(name, argparse.Namespace(**{**vars(args), "seq_len": seq_len}), device)
        mfu = "null" if row["mfu"] is None else f"{100 * float(row['mfu']):.1f}%"  # type: ignore[arg-type]
        print(
            f"{name:>14}: {row['num_params']:>11,} params  batch {row['batch_size']}x{seq_len}  "
            f"{row['step_ms']:>9} ms/step  {row['tokens_per_s']:>11,} tok/s  "
            f"{row['tflops']} TFLOP/s  MFU {mfu}  peak memory {row['peak_memory_gb']} GB"
        )
        results.append(row)
    figures = {
        "benchmark": "gpu",
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "torch": torch.__version__,
        "compile": args.compile,
        "peak_flops": peak,
        "mfu_reason": None if peak else peak_source,
        "results": results,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
