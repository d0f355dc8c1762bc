"""Merge path speed: parse + verify + decode + validate + apply one update, against SHA-256.

    python -m bench.merge_speed                      # small, fp32, 8 updates of a swarm of 8
    python -m bench.merge_speed --codec bf16 --model tiny

Each update goes the way a peer's does: the envelope bytes as received are parsed
(SignedUpdate.from_bytes) and submitted to a real UpdatePipeline over a replica of the model's
genesis parameters. SHA-256 over the same envelope bytes is timed in the same process,
interleaved with the merges, so both see the same machine load; both rates are over all the
updates (a round of M updates includes one fold of the outer momentum). Target (issue 9.3): merge
GB/s >= 0.9 x SHA-256 GB/s. The final line is JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import torch
from torch.nn.utils import parameters_to_vector

from merge.codecs import CODECS, get_codec
from merge.envelope import SignedUpdate, seal
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.weighting import TokenWeightConfig
from node.model import build_model, model_config

FINGERPRINT = hashlib.sha256(b"merge-speed").hexdigest()
TARGET_RATIO = 0.9


def make_pipeline(genesis: torch.Tensor) -> UpdatePipeline:
    config = MergeConfig(
        outer=OuterConfig(),
        token_weight=TokenWeightConfig(reference_tokens=1000),
        max_inner_steps=100,
        max_tokens_per_step=1000,
    )
    replica = Replica(genesis.clone(), make_outer_optimizer(config.outer, genesis.numel()))
    return UpdatePipeline(replica, config, FINGERPRINT)


def make_envelopes(
    genesis: torch.Tensor, codec_name: str, count: int, learners: int
) -> list[bytes]:
    """Signed updates from one author with seqs 0..count-1, as the bytes a peer sends."""
    author = Identity.from_private_bytes(b"m" * 32)
    codec = get_codec(codec_name)
    generator = torch.Generator().manual_seed(0)
    envelopes = []
    for seq in range(count):
        delta = torch.randn(genesis.numel(), generator=generator) * 1e-4
        update = seal(
            author,
            fingerprint=FINGERPRINT,
            seq=seq,
            base_applied=seq,
            published_applied=seq,
            inner_steps=100,
            tokens=100_000,
            loss=3.0,
            codec=codec.name,
            numel=genesis.numel(),
            payload=codec.encode(delta),
            learners=learners,
        )
        envelopes.append(update.to_bytes())
    return envelopes


def time_s(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=("tiny", "small", "base"))
    parser.add_argument("--codec", default="fp32", choices=sorted(CODECS))
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--learners", type=int, default=8, help="swarm size the updates claim (M)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the merges")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    genesis = parameters_to_vector(build_model(model_config(args.model), 0).parameters()).detach()
    envelopes = make_envelopes(genesis, args.codec, args.updates + 1, args.learners)
    pipeline = make_pipeline(genesis)
    merge_one(pipeline, envelopes.pop(0))  # warm-up: first-touch allocations, thread pools
    merge_s, sha_s = [], []
    profiler = _start_profile() if args.profile else None
    for wire in envelopes:
        sha_s.append(time_s(lambda wire=wire: hashlib.sha256(wire).digest()))
        merge_s.append(time_s(lambda wire=wire: merge_one(pipeline, wire)))
    if profiler is not None:
        _print_profile(profiler)
    report(args, genesis.numel(), len(envelopes[0]), merge_s, sha_s, pipeline)


def merge_one(pipeline: UpdatePipeline, wire: bytes) -> None:
    result = pipeline.submit(SignedUpdate.from_bytes(wire))
    if not result.accepted:
        raise SystemExit(f"the benchmark's update was rejected: {result.reason}")


def report(
    args: argparse.Namespace,
    numel: int,
    num_bytes: int,
    merge_s: list[float],
    sha_s: list[float],
    pipeline: UpdatePipeline,
) -> None:
    # Throughput over all the updates: a round of M of them includes one momentum fold.
    merge_gbps = num_bytes * len(merge_s) / sum(merge_s) / 1e9
    sha_gbps = num_bytes * len(sha_s) / sum(sha_s) / 1e9
    print(
        f"{args.model} ({numel:,} params), {args.codec}: {num_bytes / 1e6:.1f} MB per update, "
        f"{len(merge_s)} updates merged"
    )
    print(f"merge path: {merge_gbps:.2f} GB/s ({1e3 * statistics.mean(merge_s):.1f} ms/update)")
    print(f"SHA-256:    {sha_gbps:.2f} GB/s ({1e3 * statistics.mean(sha_s):.1f} ms/update)")
    ratio = merge_gbps / sha_gbps
    print(f"ratio:      {ratio:.2f} (target >= {TARGET_RATIO})")
    figures = {
        "benchmark": "merge_speed",
        "model": args.model,
        "codec": args.codec,
        "num_params": numel,
        "update_bytes": num_bytes,
        "updates": len(merge_s),
        "learners": args.learners,
        "merged": pipeline.num_merged - 1,
        "merge_gbps": round(merge_gbps, 3),
        "sha256_gbps": round(sha_gbps, 3),
        "ratio": round(ratio, 3),
        "target_ratio": TARGET_RATIO,
        "torch_threads": torch.get_num_threads(),
    }
    print(json.dumps(figures))


def _start_profile() -> object:
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    return profiler


def _print_profile(profiler: object) -> None:
    import pstats

    profiler.disable()  # type: ignore[attr-defined]
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
