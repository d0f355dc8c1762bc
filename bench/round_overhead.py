"""Share of a DiLoCo round spent outside inner steps (encode, hash, sign, verify, merge).

    python -m bench.round_overhead                 # small, H = 50, 3 rounds on this machine
    python -m bench.round_overhead --model tiny --rounds 2

Target (issue 2): below 5% for `small` on CPU with H = 50. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from node.config import JoinConfig
from node.events import RecordingEventLog
from node.runtime import Node


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", choices=("tiny", "small", "base"))
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codec", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        events = RecordingEventLog()
        config = JoinConfig(
            model=args.model,
            inner_steps=args.inner_steps,
            max_rounds=args.rounds,
            codec=args.codec,
            threads=args.threads,
            identity=str(Path(tmp) / "id.key"),
            checkpoint_dir=str(Path(tmp) / "ckpt"),
            checkpoint_every=10**9,
            log_format="json",
        )
        node = Node(config, events)
        node.run()
    rounds = events.of("round_done")
    for r in rounds:
        print(
            f"round {r['round']}: {r['round_s']:.2f} s, inner {r['inner_s']:.2f} s, "
            f"encode {r['encode_s'] * 1e3:.1f} ms, hash+sign {r['seal_s'] * 1e3:.1f} ms, "
            f"verify+merge {r['merge_s'] * 1e3:.1f} ms, eval {r['eval_s'] * 1e3:.0f} ms"
        )
    overhead = [r["encode_s"] + r["seal_s"] + r["merge_s"] for r in rounds]
    round_s = [r["round_s"] for r in rounds]
    figures = {
        "benchmark": "round_overhead",
        "model": args.model,
        "num_params": node.num_params,
        "inner_steps": args.inner_steps,
        "codec": args.codec,
        "rounds": len(rounds),
        "round_s_median": round(statistics.median(round_s), 3),
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
        "target_overhead_share": 0.05,
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
