"""N nodes on loopback with one crash a minute: do live replicas agree, what does a node pay?

    python -m bench.scale                            # N = 2, 4, 8; tiny; ~8 minutes on 2 cores
    python -m bench.scale --sizes 2 4 8 16 --train-s 300    # longer
    python -m bench.scale --sim --nodes 8,64,1000            # learner groups, simulated

--sim runs bench.scale_sim instead (no processes): learner groups on a virtual clock and
network, see that module and docs/scale.md.

For each N: all nodes train `tiny` with a small H for --train-s seconds while one node a
minute is killed with SIGKILL (its whole process group) and restarted at once with the same
identity and checkpoints. Then every node stops publishing and lingers. Measured, from the
nodes' signed heartbeats (read through a DHT observer every second) and their JSON events:

- agree_share: share of samples in which every live node reported the same applied digest
  (while training, updates in flight count as disagreement);
- converge_s: after the last node stopped training, how long until all live replicas hold
  one applied set;
- max_drift: the largest relative distance between two replicas with equal applied sets
  (median_drift: its median over all rounds; final_drift: between the last heartbeats);
- settled_drift, settle_s: the same once the replicas had until --linger-s + 15 s after the
  last end of training to realign (dht.realign's settle), and when it reached 0.0;
- rss_mb: resident memory of each node's main process (mean of per-node peaks, and max);
- mb_received_per_round: update and state payload megabytes one node fetched per round it
  trained, realignments' states included since session 22 (DHT records and heartbeats
  excluded), and the same divided by N - 1;
- lost: updates declared lost (no live holder), summed over the last heartbeats; need_state:
  those waiting for a state to bring them instead (no live holder, applied by a live
  state-serving peer), likewise, and need_state_events: every `update_needs_state` of the run;
- sized_differently: update ids the nodes' last processes merged with different weights
  (learner counts) or robust verdicts: what drift with one applied set is made of;
- exit_*, converged_at_exit: the replicas as the nodes left them, from each node's own last
  event (`stopped`: applied digest, count, sketch), after every node exited: the judgement
  that does not depend on the DHT observer (at N = 16 it read 4-9 samples in 6 minutes).

The nodes' heartbeat period is 1 s up to 4 nodes and N / 4 s above (`heartbeat_period`),
their gap wait 10 periods and the convergence bound --linger-s periods: all N share this
machine's cores, and at 1 s 16 nodes missed their own liveness window.

The figures for `base` at 100 and 1000 nodes are extrapolated from the measured per-update
payload: under gossip of full updates each node receives every other node's update once per
round, so a node's bytes per round grow as (N - 1) x the update size. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from bench.scale_figures import extrapolate
from bench.scale_run import measure

if TYPE_CHECKING:
    from bench.scale_sim_state import SimConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--train-s", type=float, default=80.0, help="training time per N")
    parser.add_argument("--kill-every", type=float, default=60.0, help="seconds between crashes")
    parser.add_argument("--linger-s", type=float, default=40.0, help="bound on convergence")
    parser.add_argument("--inner-steps", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300.0, help="bound on start-up waits")
    parser.add_argument(
        "--startup-s", type=float, help="time allowed for starting every node (default 20 s x N)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--events-dir", type=Path, help="keep every process's JSON events here (nN/, a file each)"
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=0,
        help="learner groups (join --group-size; 0: off); --sim: the grouping's target group "
        "size, as join's --group-size sets it (0: the policy's default, 8)",
    )
    parser.add_argument("--sim", action="store_true", help="simulate learner groups instead")
    parser.add_argument("--nodes", default="8,64,1000", help="--sim: comma-separated swarm sizes")
    parser.add_argument(
        "--wired",
        action="store_true",
        help="--sim: count bytes as real nodes move them now (whole parts, whole fetches)",
    )
    parser.add_argument(
        "--scatter",
        action="store_true",
        help="with --group-size: join --group-scatter (reduce-scatter inside a group); "
        "--sim: count merge.group_shards' reduce-scatter message by message (with --wired: "
        "other groups' updates fetched whole, as real nodes do; without: by shards)",
    )
    parser.add_argument(
        "--balanced",
        action="store_true",
        help="with --group-size: identities that give every group N / G members "
        "(bench.scale_keys), so that rows of one command are like for like; --sim: the "
        "first nodes' identities alike",
    )
    parser.add_argument(
        "--shard-fetch",
        action="store_true",
        help="with --group-size and --scatter: join --group-shard-fetch (each member fetches "
        "its slice of other groups' updates; docs/scale.md, Session 17)",
    )
    parser.add_argument(
        "--bf16-sums",
        action="store_true",
        help="--sim --scatter: count the fetch round's sums in bf16 instead of fp32",
    )
    parser.add_argument(
        "--fold",
        action="store_true",
        help="with --shard-fetch: join --group-fold (the own group's update folded into its "
        "members' fetch round; docs/scale.md, Session 29)",
    )
    parser.add_argument(
        "--fold-own",
        action="store_true",
        help="--sim: the default since session 29 (the own group's update folded into its "
        "members' fetch round, as nodes with --group-fold run it); kept for old commands",
    )
    parser.add_argument(
        "--all-gather-own",
        action="store_true",
        help="--sim --scatter: count the own group's reduced shards all-gathered inside the "
        "group (nodes without --group-fold) instead of folded into the fetch round",
    )
    parser.add_argument(
        "--fold-own-replicas",
        type=int,
        default=2,
        help="--sim, folded: members holding each reduced shard (its reducer included)",
    )
    parser.add_argument(
        "--whole-past-fold",
        action="store_true",
        help="--sim --scatter: count the updates past a fold fetched whole by every member "
        "(sessions 18-26) instead of further sums of the round (real nodes since session 27)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=10,
        help="--sim: training rounds per swarm size (then 3 with no publishing); fewer fit "
        "4000 nodes in minutes, and their rows are like for like only with the same count",
    )
    args = parser.parse_args()
    if args.shard_fetch and not (args.group_size and args.scatter):
        parser.error("--shard-fetch needs --group-size and --scatter")
    if args.fold and not args.shard_fetch:
        parser.error("--fold needs --shard-fetch")
    if args.rounds < 1:
        parser.error(f"--rounds takes 1 or more, got {args.rounds}")
    if args.group_size == 2:  # join refuses it: a group of two voids itself (docs/trust.md)
        parser.error("--group-size 2 is refused by join; use 3 or more")
    if args.sim:
        _simulate(parser, args)
        return
    results = [measure(n, args) for n in args.sizes]
    summary = {
        "benchmark": "scale",
        "model": "tiny",
        "inner_steps": args.inner_steps,
        "group_size": args.group_size,
        "group_scatter": bool(args.group_size and args.scatter),
        "group_shard_fetch": bool(args.group_size and args.scatter and args.shard_fetch),
        "group_fold": bool(args.group_size and args.scatter and args.shard_fetch and args.fold),
        "balanced": bool(args.group_size and args.balanced),
        "sizes": results,
        "extrapolated_base": extrapolate(results),
    }
    print(json.dumps(summary))


def _simulate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from bench.scale_sim import parse_sizes, run

    try:
        sizes = parse_sizes(args.nodes)
    except ValueError as e:
        parser.error(str(e))
    try:
        config = _sim_config(args)
    except ValueError as e:
        parser.error(str(e))
    result = run(sizes, config)
    for row in result["rows"]:
        all_to_all = row["all_to_all_mb_per_node_per_round"]
        print(
            f"N={row['nodes']}: learners={row['learners']}, MB/node/round="
            f"{row['mb_per_node_per_round']} (all-to-all {all_to_all})",
            flush=True,
        )
    print(json.dumps(result))


def _sim_config(args: argparse.Namespace) -> SimConfig:
    from bench.scale_sim_state import SimConfig

    return SimConfig(
        seed=args.seed,
        wired=args.wired,
        scatter=args.scatter,
        group_size=args.group_size,
        balanced=args.balanced,
        sums_width=2 if args.bf16_sums else 4,
        fold_own=not args.all_gather_own,
        fold_own_replicas=args.fold_own_replicas,
        second_sum=not args.whole_past_fold,
        rounds=args.rounds,
    )


if __name__ == "__main__":
    main()
