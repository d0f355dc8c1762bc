"""The merge path's passes after the hash, whole-vector against cache-blocked (issue 9.3).

    python -m bench.blocked_passes                    # small's size, torch's threads
    python -m bench.blocked_passes --threads 1 --rounds 7

After the payload hash, merging one fp32 update reads model-sized vectors ~11 times: the
update's norm, its dot products with the two parts of the outer momentum (Delayed Nesterov's
buffer and its not-yet-folded shares), and the outer step's two in-place adds. The blocked
variant walks the vectors in chunks that fit in L2 (pass 1: norm and both dot products of a
chunk while it is in cache; pass 2: both adds of a chunk), so each vector is read once per
pass. Element-wise results are the same bits either way (checked here); the reductions only
change summation order. Both variants run alternately in one process, ``--rounds`` times
each, on the same vectors; the figures are medians with min-max spread. The final line is
JSON: per chunk size, the blocked time over the whole-vector time (below 1: blocked wins).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn.utils import parameters_to_vector

from node.model import build_model, model_config

CHUNKS = (1 << 15, 1 << 16, 1 << 18, 1 << 20)
"""Chunk sizes (elements) tried: 128 KiB to 4 MiB of fp32 per vector."""


def whole(
    g: torch.Tensor, buf: torch.Tensor, acc: torch.Tensor, params: torch.Tensor
) -> tuple[float, float, float]:
    """Today's path: each reduction and each add over the whole vector."""
    norm = float(torch.linalg.vector_norm(g))
    dots = float(torch.dot(g, buf)), float(torch.dot(g, acc))
    acc.add_(g, alpha=1e-3)
    params.add_(g, alpha=-1e-3)
    return norm, dots[0], dots[1]


def blocked(chunk: int) -> Callable[..., tuple[float, float, float]]:
    """Pass 1 and pass 2 chunk by chunk; chunk partials summed in fp64 in chunk order."""

    def run(
        g: torch.Tensor, buf: torch.Tensor, acc: torch.Tensor, params: torch.Tensor
    ) -> tuple[float, float, float]:
        n = g.numel()
        partials = torch.empty(3, -(-n // chunk), dtype=torch.float32)
        for j, start in enumerate(range(0, n, chunk)):
            gc = g[start : start + chunk]
            torch.dot(gc, gc, out=partials[0, j])
            torch.dot(gc, buf[start : start + chunk], out=partials[1, j])
            torch.dot(gc, acc[start : start + chunk], out=partials[2, j])
        sq, d_buf, d_acc = partials.double().sum(dim=1).tolist()
        for start in range(0, n, chunk):
            gc = g[start : start + chunk]
            acc[start : start + chunk].add_(gc, alpha=1e-3)
            params[start : start + chunk].add_(gc, alpha=-1e-3)
        return sq**0.5, d_buf, d_acc

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=("tiny", "small", "base"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n = parameters_to_vector(build_model(model_config(args.model), 0).parameters()).numel()
    gen = torch.Generator().manual_seed(0)
    g, buf, acc, params = (torch.randn(n, generator=gen) for _ in range(4))
    variants: dict[str, Callable[..., tuple[float, float, float]]] = {"whole": whole}
    variants.update({f"chunk_{c}": blocked(c) for c in CHUNKS})
    check_same_bits(variants, g, buf, acc, params)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():  # alternating: every variant sees the same load
            start = time.perf_counter()
            fn(g, buf, acc, params)
            times[name].append(1e3 * (time.perf_counter() - start))
    base = statistics.median(times["whole"])
    rows = {}
    print(f"{args.model}: {n:,} fp32 elements, torch threads {torch.get_num_threads()}")
    for name, ts in times.items():
        med = statistics.median(ts)
        rows[name] = {"ms": round(med, 1), "min": round(min(ts), 1), "max": round(max(ts), 1),
                      "vs_whole": round(med / base, 3)}  # fmt: skip
        print(f"  {name:>14}: {med:7.1f} ms (min {min(ts):.1f}, max {max(ts):.1f}), "
              f"{med / base:.2f}x whole")  # fmt: skip
    print(json.dumps({"benchmark": "blocked_passes", "numel": n, "rounds": args.rounds,
                      "torch_threads": torch.get_num_threads(), "rows": rows}))  # fmt: skip


def check_same_bits(
    variants: dict[str, Callable[..., tuple[float, float, float]]],
    g: torch.Tensor, buf: torch.Tensor, acc: torch.Tensor, params: torch.Tensor,
) -> None:  # fmt: skip
    """Every variant's adds give the same bits; its reductions agree to float tolerance."""
    reference = None
    for name, fn in variants.items():
        a, p = acc.clone(), params.clone()
        reductions = fn(g, buf, a, p)
        if reference is None:
            reference = (reductions, a, p)
            continue
        if not (torch.equal(a, reference[1]) and torch.equal(p, reference[2])):
            raise SystemExit(f"{name}: the outer step's adds differ from the whole-vector ones")
        for got, want in zip(reductions, reference[0], strict=True):
            if abs(got - want) > 1e-3 * max(1.0, abs(want)):
                raise SystemExit(f"{name}: reduction {got} far from {want}")


if __name__ == "__main__":
    main()
