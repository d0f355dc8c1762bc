"""Share of a DiLoCo round spent outside inner steps (encode, hash, sign, verify, merge), and
what evaluation costs it now that it runs beside training.

    python -m bench.round_overhead                 # small, H = 50, 3 rounds on this machine
    python -m bench.round_overhead --model tiny --rounds 2
    python -m bench.round_overhead --eval-every 4  # evaluate every 4th round only

Target (issue 2): below 5% for `small` on CPU with H = 50. The node runs offline (--no-swarm:
node.app composes it with the do-nothing swarm, and its `node.trainer.Trainer` runs the same
rounds, seals and merges as on the network; no p2pd, DHT or dashboard shares the machine with
the measurement). It runs twice, side by side:
with evaluation (--eval-batches, on a snapshot in a thread: issue 23) and without. eval_s of a
round is now the snapshot handed to the thread (overhead_share_with_eval counts it beside the
merge path); what the thread takes from training shows as longer rounds:
eval_beside_share = 1 - round_s without / round_s with. Partial rounds are saved in the
background as they go (node.save_cadence): partial_save_share is the copies' share of the
training thread's time, partial_save_write_ms one write beside it. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from node.config import JoinConfig
from node.events import RecordingEventLog
from node.runtime import Node


def run_node(
    args: argparse.Namespace, eval_batches: int
) -> tuple[list[dict[str, Any]], int, dict[str, float]]:
    """The node's round_done events, its parameter count and what its partial-round saves
    cost (a lone offline node, in this process: the node's own Trainer, with no swarm)."""
    with tempfile.TemporaryDirectory() as tmp:
        events = RecordingEventLog()
        config = JoinConfig(
            model=args.model,
            inner_steps=args.inner_steps,
            max_rounds=args.rounds,
            codec=args.codec,
            threads=args.threads,
            eval_batches=eval_batches,
            eval_every=args.eval_every,
            identity=str(Path(tmp) / "id.key"),
            checkpoint_dir=str(Path(tmp) / "ckpt"),
            checkpoint_every=10**9,
            log_format="json",
            swarm=False,
            dashboard=False,
        )
        node = Node(config, events)
        node.run()
    cadence = node.parts.persistence.cadence
    saves = [e for e in events.of("checkpoint_saved") if e["background"]]
    copy_s = cadence.copy_s or 0.0
    rounds = events.of("round_done")
    saving = {
        "partial_saves": len(saves),
        # Smoothed over the run (node.save_cadence): the copy on the training thread, the
        # write beside it, and the period they allowed.
        "partial_save_copy_ms": round(1e3 * copy_s, 2),
        "partial_save_write_ms": round(1e3 * (cadence.write_s or 0.0), 1),
        "partial_save_period_s": round(cadence.period_s, 2),
        "partial_save_share": round(
            len(saves) * copy_s / max(sum(r["round_s"] for r in rounds), 1e-9), 5
        ),
    }
    return rounds, node.num_params, saving


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=("tiny", "small", "base"))
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codec", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--eval-batches", type=int, default=4)
    parser.add_argument("--eval-every", type=int, default=1)
    args = parser.parse_args()
    if args.eval_batches < 1 or args.eval_every < 1:
        parser.error("--eval-batches and --eval-every must be at least 1")

    rounds, num_params, saving = run_node(args, args.eval_batches)
    without, _, _ = run_node(args, 0)
    for r in rounds:
        print(
            f"round {r['round']}: {r['round_s']:.2f} s, inner {r['inner_s']:.2f} s, "
            f"encode {r['encode_s'] * 1e3:.1f} ms, hash+sign {r['seal_s'] * 1e3:.1f} ms, "
            f"verify+merge {r['merge_s'] * 1e3:.1f} ms, eval (snapshot) {r['eval_s'] * 1e3:.1f} ms"
        )
    overhead = [r["encode_s"] + r["seal_s"] + r["merge_s"] for r in rounds]
    round_s = [r["round_s"] for r in rounds]
    round_s_without = statistics.median(r["round_s"] for r in without)
    figures = {
        "benchmark": "round_overhead",
        "model": args.model,
        "num_params": num_params,
        "inner_steps": args.inner_steps,
        "codec": args.codec,
        "rounds": len(rounds),
        "eval_batches": args.eval_batches,
        "eval_every": args.eval_every,
        "round_s_median": round(statistics.median(round_s), 3),
        "round_s_median_without_eval": round(round_s_without, 3),
        "inner_step_ms_median": round(
            1e3 * statistics.median(r["inner_s"] for r in rounds) / args.inner_steps, 2
        ),
        "encode_ms_median": round(1e3 * statistics.median(r["encode_s"] for r in rounds), 2),
        "hash_sign_ms_median": round(1e3 * statistics.median(r["seal_s"] for r in rounds), 2),
        "verify_merge_ms_median": round(1e3 * statistics.median(r["merge_s"] for r in rounds), 2),
        "eval_ms_median": round(1e3 * statistics.median(r["eval_s"] for r in rounds), 1),
        "overhead_share": round(sum(overhead) / sum(round_s), 5),
        "overhead_share_with_eval": round(
            sum(o + r["eval_s"] for o, r in zip(overhead, rounds, strict=True)) / sum(round_s), 5
        ),
        "eval_beside_share": round(1 - round_s_without / statistics.median(round_s), 5),
        "target_overhead_share": 0.05,
        **saving,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
