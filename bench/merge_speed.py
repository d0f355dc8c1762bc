"""Merge path speed: parse + verify + decode + validate + apply one update, against SHA-256.

    python -m bench.merge_speed                     # small: fp32 and bf16, 8 updates, swarm of 8
    python -m bench.merge_speed --codecs bf16 --model tiny

Each update goes the way a peer's does: the envelope bytes as received are parsed
(SignedUpdate.from_bytes) and submitted to a real UpdatePipeline over a replica of the model's
genesis parameters. SHA-256 over the same envelope bytes is timed in the same process,
interleaved with the merges, so both see the same machine load; both rates are over all the
updates (a round of M updates includes one fold of the outer momentum). The updates look like a
training swarm's: a shared direction plus as much noise of each update's own (pairwise cosine
~0.5), so honest updates point along the outer momentum as they do in training.

Beside the path, the same run times its floor: BLAKE3 over the payload, and the outer step
alone (decode and outer.step of the update), which no verification can avoid; each stage of
the path on its own, on a replica of its own ("stages_ms": hash, decode, update norm, params
norm, robust dot products, outer step: where the time goes); and each codec's encode and
decode of a model-sized vector (the codecs' speed figures; unit tests are not timed).
Target (issue 9.3): merge GB/s >= 0.9 x SHA-256 GB/s. The final line is JSON: the first
codec's figures at the top level, every codec's in "rows".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time

import blake3
import torch
from torch.nn.utils import parameters_to_vector

from merge.codec_base import DecodesInto
from merge.codecs import CODECS, get_codec
from merge.envelope import SignedUpdate, payload_matches, seal
from merge.identity import Identity
from merge.outer import make_outer_optimizer
from merge.pipeline import UpdatePipeline
from merge.replica import Replica
from node.builders import build_merge_config
from node.model import build_model, model_config
from node.settings import RunSettings

FINGERPRINT = hashlib.sha256(b"merge-speed").hexdigest()
TARGET_RATIO = 0.9


def make_pipeline(genesis: torch.Tensor, codec: str) -> UpdatePipeline:
    """A node's merge path for updates in `codec`: its merge config as node.builders builds it
    from the default settings (H = 100 inner steps of 1000 tokens, as the envelopes say)."""
    config = build_merge_config(RunSettings(inner_steps=100, codec=codec), tokens_per_step=1000)
    replica = Replica(genesis.clone(), make_outer_optimizer(config.outer, genesis.numel()))
    return UpdatePipeline(replica, config, FINGERPRINT)


def make_envelopes(
    genesis: torch.Tensor, codec_name: str, count: int, learners: int
) -> list[bytes]:
    """Signed updates from one author with seqs 0..count-1, as the bytes a peer sends."""
    author = Identity.from_private_bytes(b"m" * 32)
    codec = get_codec(codec_name)
    generator = torch.Generator().manual_seed(0)
    direction = torch.randn(genesis.numel(), generator=generator)
    envelopes = []
    for seq in range(count):
        delta = (direction + torch.randn(genesis.numel(), generator=generator)) * 1e-4
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
    parser.add_argument("--codecs", default="fp32,bf16", help="comma-separated, from CODECS")
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--learners", type=int, default=8, help="swarm size the updates claim (M)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of the merges")
    args = parser.parse_args()
    codecs = args.codecs.split(",")
    if any(c not in CODECS for c in codecs):
        parser.error(f"--codecs: each one of {sorted(CODECS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    genesis = parameters_to_vector(build_model(model_config(args.model), 0).parameters()).detach()
    rows = [measure(args, genesis, codec) for codec in codecs]
    print(json.dumps({**rows[0], "codec_speed": codec_speed(genesis), "rows": rows}))


def measure(args: argparse.Namespace, genesis: torch.Tensor, codec: str) -> dict:
    """One codec's row: the merge path, SHA-256, BLAKE3 and the outer step, interleaved."""
    envelopes = make_envelopes(genesis, codec, args.updates + 1, args.learners)
    pipeline = make_pipeline(genesis, codec)
    warm_up = envelopes.pop(0)
    merge_one(pipeline, warm_up)  # warm-up: first-touch allocations, thread pools
    floor = make_pipeline(genesis, codec)  # the outer step alone, on a replica of its own
    scratch = torch.empty(genesis.numel())  # the decode buffer the pipeline reuses
    floor_one(floor, envelopes[0], scratch)
    stages = make_pipeline(genesis, codec)  # each stage on its own, on a third replica
    stages_one(stages, SignedUpdate.from_bytes(warm_up), scratch)
    times: dict[str, list[float]] = {"merge": [], "sha": [], "blake3": [], "apply": []}
    stage_times: dict[str, list[float]] = {}
    profiler = _start_profile() if args.profile else None
    for wire in envelopes:
        update = SignedUpdate.from_bytes(wire)
        times["sha"].append(time_s(lambda wire=wire: hashlib.sha256(wire).digest()))
        times["merge"].append(time_s(lambda wire=wire: merge_one(pipeline, wire)))
        times["blake3"].append(time_s(lambda u=update: blake3.blake3(u.payload).digest()))
        times["apply"].append(time_s(lambda u=update: floor_one(floor, u, scratch)))
        for name, seconds in stages_one(stages, update, scratch).items():
            stage_times.setdefault(name, []).append(seconds)
    if profiler is not None:
        _print_profile(profiler)
    row = report(args, codec, genesis.numel(), len(envelopes[0]), times, pipeline)
    return {**row, "stages_ms": report_stages(stage_times, times["sha"])}


def merge_one(pipeline: UpdatePipeline, wire: bytes) -> None:
    result = pipeline.submit(SignedUpdate.from_bytes(wire))
    if not result.accepted:
        raise SystemExit(f"the benchmark's update was rejected: {result.reason}")


def floor_one(
    pipeline: UpdatePipeline, update: SignedUpdate | bytes, scratch: torch.Tensor
) -> None:
    """Decode and outer step only: what applying an update costs with no check at all."""
    if isinstance(update, bytes):
        update = SignedUpdate.from_bytes(update)
    header = update.header
    pseudo_gradient = decode(update, scratch)
    replica = pipeline.replica
    replica.outer.step(replica.params, pseudo_gradient, 1.0, header.learners or 1)


def decode(update: SignedUpdate, scratch: torch.Tensor) -> torch.Tensor:
    """The update decoded as the pipeline decodes it: into its reused buffer, or a view."""
    header, codec = update.header, get_codec(update.header.codec)
    if isinstance(codec, DecodesInto):
        return codec.decode_into(update.payload, header.numel, scratch[: header.numel])
    return codec.decode_view(update.payload, header.numel)


def stages_one(
    pipeline: UpdatePipeline, update: SignedUpdate, scratch: torch.Tensor
) -> dict[str, float]:
    """Seconds of each stage of the merge path, one after the other, as the pipeline runs
    them (the params norm exactly: the path skips that pass while its bounds settle it)."""
    header, replica = update.header, pipeline.replica
    threads = torch.get_num_threads()
    seconds = {"hash": time_s(lambda: payload_matches(header, update.payload, max_threads=threads))}
    start = time.perf_counter()
    pseudo_gradient = decode(update, scratch)
    seconds["decode"] = time.perf_counter() - start
    start = time.perf_counter()
    norm = float(torch.linalg.vector_norm(pseudo_gradient))
    seconds["update_norm"] = time.perf_counter() - start
    seconds["params_norm"] = time_s(replica.params_norm)
    parts = replica.outer.momentum_parts()
    seconds["robust_dots"] = time_s(lambda: pipeline.robust.judge(pseudo_gradient, parts, norm))
    seconds["outer_step"] = time_s(
        lambda: replica.apply(header, pseudo_gradient, pipeline.weight_of(header), norm)
    )
    return seconds


def report_stages(stage_times: dict[str, list[float]], sha: list[float]) -> dict[str, float]:
    """Mean ms per update of each stage, printed beside SHA-256's."""
    ms = {name: round(1e3 * statistics.mean(ts), 2) for name, ts in stage_times.items()}
    ms["sha256"] = round(1e3 * statistics.mean(sha), 2)
    print("  stages (ms/update, each alone): " + ", ".join(f"{k} {v:.1f}" for k, v in ms.items()))
    return ms


def report(
    args: argparse.Namespace,
    codec: str,
    numel: int,
    num_bytes: int,
    times: dict[str, list[float]],
    pipeline: UpdatePipeline,
) -> dict:
    # Throughput over all the updates: a round of M of them includes one momentum fold.
    gbps = {name: num_bytes * len(ts) / sum(ts) / 1e9 for name, ts in times.items()}
    ms = {name: 1e3 * statistics.mean(ts) for name, ts in times.items()}
    updates = len(times["merge"])
    print(
        f"{args.model} ({numel:,} params), {codec}: {num_bytes / 1e6:.1f} MB per update, "
        f"{updates} updates merged"
    )
    for name, label in (
        ("merge", "merge path"), ("sha", "SHA-256"), ("blake3", "BLAKE3"), ("apply", "outer step")
    ):  # fmt: skip
        print(f"  {label:11} {gbps[name]:6.2f} GB/s ({ms[name]:6.1f} ms/update)")
    ratio = gbps["merge"] / gbps["sha"]
    print(f"  ratio       {ratio:6.2f} (target >= {TARGET_RATIO}); outer step alone / SHA-256: "
          f"{gbps['apply'] / gbps['sha']:.2f}")  # fmt: skip
    return {
        "benchmark": "merge_speed",
        "model": args.model,
        "codec": codec,
        "num_params": numel,
        "update_bytes": num_bytes,
        "updates": updates,
        "learners": args.learners,
        "merged": pipeline.num_merged - 1,
        "merge_gbps": round(gbps["merge"], 3),
        "sha256_gbps": round(gbps["sha"], 3),
        "ratio": round(ratio, 3),
        "blake3_gbps": round(gbps["blake3"], 3),
        "outer_step_gbps": round(gbps["apply"], 3),
        "outer_step_ratio": round(gbps["apply"] / gbps["sha"], 3),
        "target_ratio": TARGET_RATIO,
        "torch_threads": torch.get_num_threads(),
    }


def codec_speed(genesis: torch.Tensor) -> dict[str, dict[str, float]]:
    """Encode and decode GB/s (of fp32 input) of every codec on a model-sized vector."""
    flat = torch.randn(genesis.numel(), generator=torch.Generator().manual_seed(1)) * 1e-4
    figures = {}
    for name, codec in CODECS.items():
        encode_s = min(time_s(lambda c=codec: c.encode(flat)) for _ in range(2))
        payload = codec.encode(flat)
        decode_s = min(
            time_s(lambda c=codec, p=payload: c.decode(p, flat.numel())) for _ in range(2)
        )
        figures[name] = {
            "encode_gbps": round(4 * flat.numel() / encode_s / 1e9, 3),
            "decode_gbps": round(4 * flat.numel() / decode_s / 1e9, 3),
        }
        print(
            f"  {name:>6}: encode {figures[name]['encode_gbps']:6.2f} GB/s, "
            f"decode {figures[name]['decode_gbps']:6.2f} GB/s (of fp32 values)"
        )
    return figures


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
