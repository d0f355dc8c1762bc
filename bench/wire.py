"""Bytes on the wire against data-parallel all-reduce, and quality of each codec at equal tokens.

    python -m bench.wire                                  # small sizes; tiny model trained
    python -m bench.wire --train-rounds 4 --codecs bf16,sparse
    python -m bench.wire --codecs bf16,sparse --train-learners 2 --train-rounds 24 \
        --train-inner-steps 10 --eval-every 6 --fragments 1   # the ratio as the run goes on

Bytes: for every codec, a real pseudo-gradient of the `--model` size is encoded and sealed;
the envelope (header, signature, payload) and the announcement (signed header) are measured
as the bytes that travel. Under gossip each of M learners receives the M - 1 other updates of
a round and, by symmetry, serves M - 1 copies of its own: (M - 1) x (envelope + announcement)
sent and as many received per round of H inner steps. Data-parallel training instead
all-reduces an fp32 gradient every inner step; a ring all-reduce sends and receives
2 (M - 1) / M gradient sizes per learner per step. Heartbeats and DHT upkeep (a few KB every
few seconds whatever the codec) are left out of both.

Quality: `--train-learners` learners train the `--train-model` in one process, each round
from the replica, and publish through the node's own path (node.publishing's WholeUpdates and
Publisher: error feedback, encode, seal, then the UpdatePipeline's verify, decode, weigh and
apply), with the outer optimizer a node with that
codec uses by default (sparse: outer momentum 0.5, merge.feedback), each learner starting its
round from the replica minus its own residual as a node does (Compressor.round_start). Every
codec sees the same data in the same order for the same tokens; the final validation loss is
compared with bf16's, and each row counts the robust verdicts (merge.robust) that clipped its
updates: the merge path judges every codec's updates by the same norms and directions. At the
end the learners stop as nodes do: each sends what its error feedback still holds once, dense
(WholeUpdates.flush, a bf16 update marked as a flush: a plain outer step, no momentum); the
final loss is after it (`val_loss_before_flush`
before), and `bytes_ratio_vs_dp_with_flush` counts the flush's bytes over a run of
`--train-rounds` rounds at the bytes' M and H.

Peak-to-mean, measured: a real node (node.runtime.Node, offline, `--schedule-model`) trains
one round of H = `--inner-steps` steps with each codec, once whole (P = 1) and once with
`--fragments P`, and its upload is binned per inner step from what it published: the signed
envelope bytes of each update (`update_bytes` of its `fragment_published` and `round_done`
events) in the step it was sealed after, as gossip serves it at once. The P rows' bytes ratio
comes from real sealed envelopes of the `--model`'s P fragments (its tensors bin-packed by
merge/fragments.py); they have no equal-tokens training run (val_loss_ratio_vs_bf16 is null).

Targets (issue 9): >= 1,000x fewer bytes than DP with the sparse codec, H = 100, M = 8;
int8, int4 and sparse within 1% of bf16's validation loss. Issue 25: topk >= 1,000x fewer
bytes than DP at M = 8, H = 100 and within 1 % of bf16 across M = 2..8 and H = 10..100:
`--grid` (bench.wire_grid) prints one row per (codec, M, H). The final line is JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.quality import Evaluator, QualityConfig
from merge.codecs import CODECS, get_codec
from merge.envelope import SignedUpdate, seal
from merge.feedback import Compressor, default_outer_momentum
from merge.fragments import partition
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.weighting import TokenWeightConfig
from node.config import JoinConfig
from node.events import RecordingEventLog
from node.model import build_model, model_config
from node.publishing import FLUSH_CODEC, Publisher, WholeUpdates
from node.runtime import Node
from node.seq_ledger import SeqLedger
from node.stats import NodeStats
from node.swarm_link import OfflineSwarm

FINGERPRINT = hashlib.sha256(b"bench.wire").hexdigest()
DP_GRADIENT_BYTES = 4
"""Bytes per element of the gradient data-parallel training all-reduces (fp32)."""


@dataclass(kw_only=True)
class WireConfig:
    """What bench.wire measures."""

    model: str = "small"
    """Model whose size the bytes are measured at."""
    learners: int = 8
    """M for the bytes comparison."""
    inner_steps: int = 100
    """H for the bytes comparison."""
    codecs: str = "bf16,int8,int4,sparse,topk"
    """Codecs compared (bf16 first: the quality reference)."""
    train_model: str = "tiny"
    """Model trained for the quality comparison."""
    train_learners: int = 4
    """Learners of the quality comparison."""
    train_rounds: int = 12
    """Rounds of the quality comparison."""
    train_inner_steps: int = 25
    """H of the quality comparison."""
    eval_batches: int = 16
    """Validation batches of the final evaluation."""
    eval_every: int = 0
    """Also evaluate every this many rounds (0: only at the end): each codec's validation loss
    over the run, and its ratio to bf16's at the same round (equal tokens)."""
    threads: int = 2
    """torch threads."""
    fragments: int = 4
    """P of the fragment rows (1: none)."""
    schedule_model: str = "tiny"
    """Model the node trains for one round to measure its publish schedule (peak-to-mean)."""
    grid: bool = False
    """Instead: each of `grid_codecs` against bf16 at every (M, H) of the grid (bench.wire_grid)."""
    grid_codecs: str = "bf16,topk"
    """Codecs of the grid (bf16 first: the quality reference)."""
    grid_learners: str = "2,4,8"
    """M of the grid."""
    grid_inner_steps: str = "10,25,100"
    """H of the grid."""
    grid_steps: int = 200
    """Inner steps per learner in each cell of the grid (rounds = grid_steps / H). The default
    grid (2 codecs, 3 x 3 cells, 200 steps, at least 2 rounds) is 16,800 tiny inner steps,
    ~20 min on an idle 2-core machine; 300 steps and 3 rounds, bench.wire's own 12 rounds of
    H = 25, is 25,200 (~30 min)."""
    grid_min_rounds: int = 2
    """Rounds of a grid cell at least."""
    grid_jobs: int = 2
    """Grid cells trained at once (one process and one torch thread each)."""


def seal_payload(
    author: Identity, codec: str, payload: bytes, numel: int, *, seq: int, applied: int,
    tokens: int, inner_steps: int, learners: int,
) -> SignedUpdate:  # fmt: skip
    return seal(
        author,
        fingerprint=FINGERPRINT,
        seq=seq,
        base_applied=applied,
        published_applied=applied,
        inner_steps=inner_steps,
        tokens=tokens,
        loss=3.0,
        codec=codec,
        numel=numel,
        payload=payload,
        learners=learners,
    )


def wire_bytes(codec: str, numel: int, inner_steps: int, learners: int) -> tuple[int, int]:
    """(envelope, announcement) bytes of a real sealed update of ``numel`` elements."""
    pseudo_gradient = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    payload = Compressor(get_codec(codec), numel).encode(pseudo_gradient)
    update = seal_payload(
        Identity.from_private_bytes(b"w" * 32), codec, payload, numel, seq=12345, applied=67890,
        tokens=inner_steps * 4096, inner_steps=inner_steps, learners=learners,
    )  # fmt: skip
    return len(update.to_bytes()), len(update.signed_header.to_bytes())


def dp_bytes_per_step(numel: int, learners: int) -> float:
    """Sent + received per learner per step by a ring all-reduce of an fp32 gradient."""
    return 2 * 2 * (learners - 1) / learners * numel * DP_GRADIENT_BYTES


def swarm_bytes_per_step(envelope: int, announcement: int, learners: int, h: int) -> float:
    """Sent + received per learner per inner step under gossip (see the module docstring)."""
    return 2 * (learners - 1) * (envelope + announcement) / h


def flush_bytes_per_step(numel: int, learners: int, h: int, rounds: int) -> float:
    """Sent + received per learner per inner step, over a run of `rounds` rounds, by each
    learner's one dense flush of its residual when it stops (a bf16 update served to the
    M - 1 others): it weighs 1 / (rounds x H) of the run, so long runs amortize it away."""
    envelope, announcement = wire_bytes(FLUSH_CODEC, numel, h, learners)
    return 2 * (learners - 1) * (envelope + announcement) / (rounds * h)


def peak_to_mean(per_step: list[int]) -> float:
    """Peak over mean of a learner's upload per inner step over a round."""
    return max(per_step) / (sum(per_step) / len(per_step))


def published_per_step(codec: str, fragments: int, config: WireConfig) -> list[int]:
    """Envelope bytes a real node published after each inner step of one round."""
    h = config.inner_steps
    with tempfile.TemporaryDirectory() as home:
        events = RecordingEventLog()
        node_config = JoinConfig(
            model=config.schedule_model, inner_steps=h, fragments=fragments, codec=codec,
            max_rounds=1, eval_batches=0, threads=config.threads, swarm=False, batch_size=1,
            identity=f"{home}/identity.key", checkpoint_dir=f"{home}/checkpoints",
            log_format="json",
        )  # fmt: skip
        Node(node_config, events).run()
    per_step = [0] * h
    for e in events.of("fragment_published"):
        per_step[e["step"] - 1] += e["update_bytes"]
    if fragments == 1:  # a whole update: sealed after the round's last step
        (done,) = events.of("round_done")
        per_step[done["steps"] - 1] += done["update_bytes"]
    seqs = {e["seq"] for e in events.of("fragment_published") + events.of("round_done")}
    merged = len([e for e in events.of("update_merged") if e["seq"] in seqs])  # not flushes
    if sum(per_step) == 0 or merged != fragments:
        raise SystemExit(f"{codec}, P = {fragments}: the node did not publish its updates")
    return per_step


def fragment_wire_bytes(
    codec: str, tensor_sizes: list[int], num_fragments: int, h: int, learners: int
) -> list[tuple[int, int]]:
    """(envelope, announcement) bytes of each fragment of a bin-packed model."""
    parts = partition(tensor_sizes, num_fragments)
    return [wire_bytes(codec, sum(tensor_sizes[i] for i in part), h, learners) for part in parts]


@dataclass(frozen=True)
class Trained:
    """What one equal-tokens training run of bench.wire gives."""

    curve: dict[int, float]
    """Validation loss after every `eval_every`-th round and the last one (the final loss
    under the key `train_rounds`)."""
    seconds: float
    """Seconds of `train_rounds` rounds of M learners."""
    robust: dict[str, int]
    """Updates whose contribution a robust verdict clipped or zeroed, by reason
    (merge.robust.REASONS): the merge path judges every codec's updates alike."""
    val_loss_unlagged: float
    """The validation loss of the replica minus the learners' mean residual before they
    flushed it: as if what they trained but had not sent had arrived (the final loss for a
    codec without error feedback). Its gap to `val_loss_before_flush` is the codec's lag."""
    val_loss_before_flush: float
    """The validation loss after the last round, before the learners stopped; the final
    loss (in `curve`) is after each sent its residual once, dense, as a stopping node does
    (node.publishing's WholeUpdates.flush)."""
    flush_updates: int
    """Learners that flushed a residual (0 for a codec without error feedback)."""


class SharedSwarm(OfflineSwarm):
    """The swarm of M learners in one process: they share one replica and its pipeline (what
    reaches one reaches all), and each signs its updates for M learners, as a node of a swarm
    of M does (`live_learners`). Nothing goes over a network."""

    def __init__(self, learners: int) -> None:
        self.learners = learners

    def live_learners(self) -> int:
        return self.learners


def node_learners(
    codec: str, config: WireConfig, ev: Evaluator, pipeline: UpdatePipeline, home: Path
) -> list[WholeUpdates]:
    """M learners, each the node's own round publishing (node.publishing: error feedback,
    round start, encode, seal, merge) with its own key, seq ledger and counters."""
    m, h = config.train_learners, config.train_inner_steps
    swarm = SharedSwarm(m)
    learners = []
    for rank in range(m):
        publisher = Publisher(
            identity=Identity.from_private_bytes(bytes([rank + 1]) * 32),
            fingerprint=FINGERPRINT,
            codec=get_codec(codec),
            replica=pipeline.replica,
            pipeline=pipeline,
            seq_ledger=SeqLedger(home / f"learner{rank}.seqs", FINGERPRINT),
            stats=NodeStats(),
            swarm=swarm,
            report_merge=lambda _: None,
        )
        learner = ev.learner(config.train_rounds * h, f"wire/{rank}")
        learners.append(WholeUpdates(publisher, learner, pipeline.config, get_codec(codec)))
    return learners


def train(codec: str, config: WireConfig, ev: Evaluator) -> Trained:
    """`train_rounds` rounds of M learners through the node's publish and merge path: every
    learner begins its round from the same replica (the node's WholeUpdates.begin), runs H
    inner steps, then each publishes (WholeUpdates.finish) into the pipeline they share.

    Not M `node.trainer.Trainer`s: a Trainer publishes at the end of its own round, so M of
    them on one replica would run one after another, each from the merge of the one before,
    which is not the round of M learners this measures."""
    started = time.perf_counter()
    h = config.train_inner_steps
    genesis = torch.nn.utils.parameters_to_vector(
        build_model(ev.model_config, 0).parameters()
    ).detach()
    pipeline = make_pipeline(genesis, h, ev.tokens_per_step, codec)
    curve: dict[int, float] = {}
    robust: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="bench-wire-") as home:
        learners = node_learners(codec, config, ev, pipeline, Path(home))
        for round_index in range(config.train_rounds):
            begun = [w.begin(None) for w in learners]
            done = [w.learner.run_round(h, lambda: False, lambda _: None) for w in learners]
            for w, base, stats in zip(learners, begun, done, strict=True):
                w.finish(base, stats)
                result = w.published[-1].result
                if not result.accepted:
                    raise SystemExit(f"{codec}: an update was rejected ({result.reason})")
                if result.robust is not None:
                    robust[result.robust] = robust.get(result.robust, 0) + 1
            rounds = round_index + 1
            due = config.eval_every and rounds % config.eval_every == 0
            if rounds == config.train_rounds or due:
                curve[rounds] = ev.val_loss(pipeline.replica.params)
        before_flush = unlagged = curve[config.train_rounds]
        residuals = [w.compressor.residual for w in learners]
        if residuals[0].numel():
            unlagged = ev.val_loss(pipeline.replica.params - torch.stack(residuals).mean(0))
        flushed = [f for f in (w.flush() for w in learners) if f is not None]
        for f in flushed:
            if not f.result.accepted:
                raise SystemExit(f"{codec}: a flush was rejected ({f.result.reason})")
            if f.result.robust is not None:  # counted apart from the rounds' updates
                key = f"flush_{f.result.robust}"
                robust[key] = robust.get(key, 0) + 1
        if flushed:  # the learners stop: each sends its residual once, dense
            curve[config.train_rounds] = ev.val_loss(pipeline.replica.params)
    seconds = time.perf_counter() - started
    return Trained(curve, seconds, robust, unlagged, before_flush, len(flushed))


def make_pipeline(
    genesis: torch.Tensor, h: int, tokens_per_step: int, codec: str
) -> UpdatePipeline:
    """The node's defaults: a round of M updates (each saying M) makes one outer step, with
    the outer momentum a node with ``codec`` uses (merge.feedback.default_outer_momentum)."""
    config = MergeConfig(
        outer=OuterConfig(momentum=default_outer_momentum(codec)),
        token_weight=TokenWeightConfig(reference_tokens=h * tokens_per_step),
        max_inner_steps=h,
        max_tokens_per_step=tokens_per_step,
    )
    outer = make_outer_optimizer(config.outer, genesis.numel())
    return UpdatePipeline(Replica(genesis.clone(), outer), config, FINGERPRINT)


def fragment_row(codec: str, tensor_sizes: list[int], config: WireConfig, dp: float) -> dict:
    """A row with P fragments: bytes of real fragment envelopes, a node's measured schedule."""
    h, m = config.inner_steps, config.learners
    parts = fragment_wire_bytes(codec, tensor_sizes, config.fragments, h, m)
    swarm = sum(swarm_bytes_per_step(e, a, m, h) for e, a in parts)
    per_step = published_per_step(codec, config.fragments, config)
    row = {
        "codec": codec,
        "fragments": len(parts),
        "bytes_ratio_vs_dp": round(dp / swarm, 1),
        "val_loss_ratio_vs_bf16": None,
        "peak_to_mean": round(peak_to_mean(per_step), 2),
        "envelope_bytes": [e for e, _ in parts],
        "bytes_per_learner_per_step": round(swarm, 1),
        "published_steps": [step + 1 for step, size in enumerate(per_step) if size],
        "published_bytes": [size for size in per_step if size],
    }
    print(
        f"{codec:>6} in {len(parts)} fragments: {swarm / 1e3:9.2f} KB/learner/step, "
        f"{row['bytes_ratio_vs_dp']:>9}x less than DP, peak/mean {row['peak_to_mean']} "
        f"(measured: {config.schedule_model} published {row['published_bytes']} bytes after "
        f"steps {row['published_steps']})"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in asdict(WireConfig()).items():
        flag = f"--{name.replace('_', '-')}"
        if isinstance(default, bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=type(default), default=default)
    config = WireConfig(**vars(parser.parse_args()))
    codecs = config.codecs.split(",")
    unknown = [c for c in codecs if c not in CODECS]
    if unknown or codecs[0] != "bf16":
        parser.error(f"--codecs: known codecs, bf16 first (unknown: {unknown})")
    torch.set_num_threads(config.threads)
    tensor_sizes = [p.numel() for p in build_model(model_config(config.model), 0).parameters()]
    numel = sum(tensor_sizes)
    if config.grid:
        from bench.wire_grid import main_grid  # it builds on this module

        return main_grid(config, numel)
    dp = dp_bytes_per_step(numel, config.learners)
    print(f"{config.model}: {numel:,} params; DP all-reduce {dp / 1e6:.2f} MB/learner/step")
    ev = Evaluator(
        QualityConfig(model=config.train_model, eval_batches=config.eval_batches, seed=0)
    )
    rows: list[dict] = []
    reference: dict[int, float] = {}
    for codec in codecs:
        envelope, announcement = wire_bytes(codec, numel, config.inner_steps, config.learners)
        swarm = swarm_bytes_per_step(envelope, announcement, config.learners, config.inner_steps)
        trained = train(codec, config, ev)
        flush = 0.0
        if trained.flush_updates:  # at --model's size, over a run of this length
            flush = flush_bytes_per_step(
                numel, config.learners, config.inner_steps, config.train_rounds
            )
        curve = trained.curve
        reference = reference or curve
        val_loss, reference_loss = curve[config.train_rounds], reference[config.train_rounds]
        per_step = published_per_step(codec, 1, config)
        ratios = {str(r): round(loss / reference[r], 5) for r, loss in curve.items()}
        row = {
            "codec": codec,
            "fragments": 1,
            "bytes_ratio_vs_dp": round(dp / swarm, 1),
            "val_loss_ratio_vs_bf16": round(val_loss / reference_loss, 5),
            "peak_to_mean": round(peak_to_mean(per_step), 2),
            "envelope_bytes": envelope,
            "bytes_per_learner_per_step": round(swarm, 1),
            "val_loss": val_loss,
            "val_loss_by_round": {str(r): loss for r, loss in curve.items()},
            "val_loss_ratio_by_round": ratios,
            "robust_clipped": trained.robust,
            "val_loss_unlagged": trained.val_loss_unlagged,
            "val_loss_before_flush": trained.val_loss_before_flush,
            "flush_updates": trained.flush_updates,
            "bytes_ratio_vs_dp_with_flush": round(dp / (swarm + flush), 1),
            "train_seconds": round(trained.seconds, 1),
        }
        rows.append(row)
        print(
            f"{codec:>6}: envelope {envelope / 1e6:8.3f} MB, {swarm / 1e3:9.2f} KB/learner/step, "
            f"{row['bytes_ratio_vs_dp']:>9}x less than DP; val loss {val_loss:.4f} "
            f"({row['val_loss_ratio_vs_bf16']:.4f} of bf16), peak/mean {row['peak_to_mean']}, "
            f"robust verdicts {trained.robust}, {trained.val_loss_unlagged:.4f} with the "
            f"residuals in, {trained.val_loss_before_flush:.4f} before the learners flushed "
            f"them ({row['bytes_ratio_vs_dp_with_flush']}x less than DP with the flush, "
            f"over {config.train_rounds} rounds)"
        )
        if len(curve) > 1:
            print("        of bf16 by round: " + ", ".join(f"{r}: {x}" for r, x in ratios.items()))
        if config.fragments > 1:
            rows.append(fragment_row(codec, tensor_sizes, config, dp))
    summary = {"benchmark": "wire", "config": asdict(config), "num_params": numel}
    print(json.dumps({**summary, "rows": rows}))


if __name__ == "__main__":
    main()
