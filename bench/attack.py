"""Hostile peers against honest nodes: what each attack class costs the swarm.

`python -m bench.attack` runs two honest nodes (tiny model, fixed seed, --rounds rounds, inner
steps paced by --pace, at most 1024 open files each) several times: --repeats clean runs and
--repeats runs per attack class, each beside bench.adversary (a participant that speaks the
real protocol) running that one class while the honest nodes train. Runs are interleaved
(repeat i: the clean run, then each class once), so a change of load on the machine falls on
clean and attacked runs alike, and every run gives each honest node the same key, made once
per invocation: a node's data order is seeded by its peer id, so clean and attacked runs
train on the same batches. The patient classes of issue 20 (zero_flood, summary_flood,
sideways, sybil_learners) keep on until the honest nodes reach their last round. Classes that
need a newcomer (poisoned_state, sybil_vouchers) get one at round --rounds/2 (or when the
poisoner is ready, if later); so do --repeats clean runs they are compared with (and only
those when every class has a newcomer).

Per class, one block of lines, then a final JSON line:
{"rows": [{class, loss_ratio_mean, loss_ratios, paired_ratios, rss_growth_mb, max_open_files,
tracebacks, counted, crashed, errors, ...}], "passed": bool, "failed": [classes], ...}.
A run's loss ratio is its worse honest node's final val loss (its last round's evaluation)
over that node's mean over the clean runs (and the newcomer's worst round from its first
over the clean newcomers', where one joined; paired_ratios, shown only: against the clean
run of the same repeat alone); a class passes
(bench.attack_rows) when the mean over its runs is within 5 %, no honest node crashed or
logged a traceback, its peak RSS stayed within 60 MB of its mean peak in the clean runs and
open files under 512. With --allow-keys the honest nodes run a permissioned swarm
(the adversary's keys are not listed) and each class must also be refused at the first
message: nothing of a stranger fetched, merged or loaded.

Time: a run takes about --rounds x 5 x --pace seconds of training plus ~30 s of start and
stop (40 rounds at 0.5 s: ~2.2 min on an idle 2-core machine), so the default (every class,
2 repeats, 4 clean runs) is 42 runs, ~95 min; `--classes new` (issue 20's five) ~14 runs,
~30 min; `--classes zero_flood --rounds 16 --repeats 1` ~3 min.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from bench.adversary import ATTACKS, GROUP_CLASSES, NEWCOMER_CLASSES, PATIENT
from bench.attack_rows import (
    RunFigures,
    class_row,
    clean_means,
    clean_peaks,
    clean_tails,
    format_row,
    mean_cpu_s,
    newcomer_mean,
    paired_ratios,
)
from bench.attack_swarm import (  # honest_keys, last_val, wait_last_evaluation: the tests' names
    Settings,
    honest_keys,
    last_val,
    run_swarm,
    wait_last_evaluation,
)
from node.allocator import SPEC_ENV, parse_spec

__all__ = ["honest_keys", "last_val", "main", "parse_classes", "wait_last_evaluation"]

CLASS_GROUPS = {"all": tuple(c for c in ATTACKS if c not in GROUP_CLASSES), "new": PATIENT}


def clean_spread(cleans: list[RunFigures]) -> float | None:
    """The widest ratio between two clean runs' final losses of one node: the noise floor a
    loss ratio is read against (None with fewer than two clean runs)."""
    spreads = []
    for name in {n for c in cleans for n in c.final_val}:
        vals = [v for c in cleans if (v := c.final_val.get(name)) is not None]
        if len(vals) > 1:
            spreads.append(max(vals) / min(vals))
    return round(max(spreads), 4) if spreads else None


def parse_classes(value: str) -> list[str]:
    classes: list[str] = []
    for name in (c.strip() for c in value.split(",") if c.strip()):
        classes += CLASS_GROUPS.get(name, (name,))
    if unknown := sorted(set(classes) - set(ATTACKS)):
        raise argparse.ArgumentTypeError(
            f"unknown classes {unknown}; choose from all, new, {', '.join(ATTACKS)}"
        )
    return list(dict.fromkeys(classes))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--classes", "--attacks", type=parse_classes, default="all",
        help="comma-separated attack classes, or 'all' (default), or 'new' (issue 20's: "
        f"{', '.join(PATIENT)}); all: {', '.join(ATTACKS)}",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=40, help="rounds each honest node trains")
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs per class, and clean runs (default 2)"
    )
    parser.add_argument(
        "--pace", type=float, default=0.5,
        help="seconds per honest inner step (emulated, every run): 40 rounds of 5 steps last "
        "~100 s, so every class runs while the honest nodes train; 0: full speed",
    )  # fmt: skip
    parser.add_argument(
        "--allow-keys", action="store_true",
        help="permissioned swarm: the honest nodes list only their own keys (--allow-keys "
        "FILE), and every class must be refused at the first message at no cost to training",
    )  # fmt: skip
    parser.add_argument("--sybils", type=int, default=1000, help="the adversary's Sybil keys")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds after each class")
    parser.add_argument(
        "--events-dir", type=Path, help="keep every process's JSON events here, one file each"
    )
    parser.add_argument(
        "--malloc", type=malloc_spec,
        help="the honest nodes' allocator (DILOCO_MALLOC, node/allocator.py): 'glibc' leaves "
        "glibc's defaults, 'arena_max=2,trim_period_s=0' sets some; default: the node's own",
    )  # fmt: skip
    return parser


def malloc_spec(value: str) -> str:
    try:
        parse_spec(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if set(args.classes) & set(GROUP_CLASSES):  # a learner-group run (bench.attack_group)
        from bench.attack_group import main as group_main

        extra = ["--events-dir", str(args.events_dir)] if args.events_dir else []
        return group_main(["--classes", ",".join(args.classes), "--pace", str(args.pace), *extra])
    if args.rounds < 4 or args.repeats < 1:
        build_parser().error("--rounds must be at least 4 and --repeats at least 1")
    if args.malloc is not None:  # every node the bench starts reads it (node.allocator)
        os.environ[SPEC_ENV] = args.malloc
    with_newcomer = any(c in NEWCOMER_CLASSES for c in args.classes)
    with tempfile.TemporaryDirectory(prefix="diloco-attack-") as tmp:
        work = Path(tmp)
        (work / "keys").mkdir()
        settings = Settings(
            rounds=args.rounds, pace_s=args.pace, sybils=args.sybils, settle_s=args.settle,
            allow_keys=args.allow_keys, events_dir=args.events_dir,
            keys=honest_keys(work / "keys"),
        )  # fmt: skip

        def run(name: str, attack: str | None, newcomer: bool) -> RunFigures:
            figures = run_swarm(work / name, settings, attack, newcomer)
            load = os.getloadavg()[0]
            print(f"{name}: final val loss {figures.final_val}"
                  + (f", newcomer by round {figures.newcomer_curve}" if newcomer else "")
                  + f" ({figures.seconds:.0f} s, load {load:.1f})", flush=True)  # fmt: skip
            return figures

        # Interleaved: repeat i runs the clean pair, then every class once, so a change of
        # load on the machine falls on clean and attacked runs alike.
        cleans: list[RunFigures] = []
        cleans_newcomer: list[RunFigures] = []
        attacked: dict[str, list[RunFigures]] = {c: [] for c in args.classes}
        for i in range(args.repeats):
            if any(c not in NEWCOMER_CLASSES for c in args.classes):
                cleans.append(run(f"clean{i}", None, False))
            if with_newcomer:
                cleans_newcomer.append(run(f"clean-newcomer{i}", None, True))
            for attack in args.classes:
                newcomer = attack in NEWCOMER_CLASSES
                attacked[attack].append(run(f"{attack}{i}", attack, newcomer))
        clean, clean_new = clean_means(cleans), clean_means(cleans_newcomer)
        rows = []
        for attack in args.classes:
            newcomer = attack in NEWCOMER_CLASSES
            runs = attacked[attack]
            base = clean_new if newcomer else clean
            base_newcomer = newcomer_mean(cleans_newcomer) if newcomer else None
            paired = cleans_newcomer if newcomer else cleans
            peak = clean_peaks(paired)
            row = class_row(
                runs, base, base_newcomer, allow_keys=args.allow_keys, clean_peak=peak,
                clean_tail=clean_tails(paired),
            )  # fmt: skip
            row["paired_ratios"] = paired_ratios(runs, paired)
            rows.append(row)
            print(format_row(rows[-1]), flush=True)
    failed = [r["class"] for r in rows if not r["passed"]]
    summary = {
        "rows": rows,
        "passed": not failed,
        "failed": failed,
        "clean_val_loss": [c.final_val for c in cleans],
        "clean_spread": clean_spread(cleans + cleans_newcomer),
        "clean_peak_rss_mb": [c.peak_rss_mb for c in cleans],
        "clean_rss_growth_in_run_mb": [round(c.rss_growth_mb, 1) for c in cleans],
        "clean_cpu_s": mean_cpu_s(cleans + cleans_newcomer),
        "clean_newcomer_val_loss": [[c.final_val, c.newcomer_curve] for c in cleans_newcomer],
        "rounds": args.rounds,
        "repeats": args.repeats,
        "pace_s": args.pace,
        "allow_keys": args.allow_keys,
        "malloc": args.malloc,
    }
    print(f"clean runs' spread (noise floor): {summary['clean_spread']}", flush=True)
    print(f"classes failing a target: {failed or 'none'}", flush=True)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
