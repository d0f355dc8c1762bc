"""Hostile peers against honest nodes: what each attack class costs the swarm.

`python -m bench.attack` runs two honest nodes (tiny model, fixed seed, a fixed number of
rounds, at most 1024 open files each) once without an attacker (the clean run) and once with
bench.adversary, a participant that speaks the real protocol, running every attack class in
turn. One line per class: what the honest nodes counted (rejections by reason, read from
their signed heartbeats), the rounds they advanced meanwhile, their validation loss at the end
of the class over the clean run's at the same round, and their peak RSS so far. The last line
is JSON: {"rows": [...], "clean_val_loss": ..., ...}.

With --separate each class gets its own attacked run (cleaner attribution, ~1 min a class).
The attacked runs go first: when the poisoner's class brings a newcomer in, the clean run it is
compared with gets one at the same round of honest0 (they compare the same learners; only the
pair that trains the whole run is compared).
Target: the honest nodes keep training, count every rejection with its reason, and end within
5 % of the clean run's validation loss.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.adversary import ATTACKS
from bench.procs import (
    ChildProcess,
    WaitError,
    node_process,
    python_module,
    reap_all,
    save_events,
)

RUN = ["--model", "tiny", "--threads", "1", "--inner-steps", "5", "--eval-batches", "2",
       "--heartbeat-period", "1", "--gap-wait", "10", "--seed", "0"]  # fmt: skip
MAX_OPEN_FILES = 1024
START_S = 180.0
NEWCOMER = ("newcomer", "--max-rounds", "3")
LOSS_TOLERANCE = 0.05


def peak_rss_mb(pid: int) -> float:
    """VmHWM: the highest resident set size the process has had."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def open_files(pid: int) -> int:
    """File descriptors the process holds now."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


class RssSampler:
    """Peak RSS of each honest node's main process, sampled once a second with its time."""

    def __init__(self, nodes: list[ChildProcess]) -> None:
        self.nodes = nodes
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.fd_samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            sample = {n.name: peak_rss_mb(n.pid) for n in list(self.nodes) if n.alive()}
            fds = {n.name: open_files(n.pid) for n in list(self.nodes) if n.alive()}
            self.samples.append((time.time(), sample))
            self.fd_samples.append((time.time(), fds))

    def peak_at(self, when: float) -> float:
        seen = [max(s.values(), default=0.0) for t, s in self.samples if t <= when + 1]
        return max(seen, default=0.0)

    def max_fds(self, start: float, end: float) -> int:
        seen = [max(s.values(), default=0) for t, s in self.fd_samples if start <= t <= end + 1]
        return max(seen, default=0)


@dataclass
class RunResult:
    honest: list[ChildProcess]
    adversary: ChildProcess | None
    rss: RssSampler
    attacks: list[dict[str, Any]] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)
    newcomer_round: int | None = None
    """honest0's last round when the newcomer was launched (None: no newcomer)."""

    @property
    def pair(self) -> list[ChildProcess]:
        """The two nodes that train the whole run (the newcomer joins for a few rounds)."""
        return [n for n in self.honest if n.name != "newcomer"]

    def val_curve(self, node: ChildProcess) -> dict[int, float]:
        return {e["round"]: e["val_loss"] for e in node.of("round_done") if e["val_loss"]}

    def at(self, node: ChildProcess, when: float) -> tuple[int, float | None]:
        done = [e for e in node.of("round_done") if e["time"] <= when and e["val_loss"]]
        return (done[-1]["round"], done[-1]["val_loss"]) if done else (0, None)


def run_swarm(
    workdir: Path,
    rounds: int,
    attacks: list[str],
    sybils: int,
    settle_s: float,
    pace_s: float,
    events_dir: Path | None = None,
    newcomer_at_round: int | None = None,
) -> RunResult:
    """One run of the honest pair, attacked by `attacks` (none: the clean run). A newcomer
    joins when the poisoner serves its state, or (the clean run of an attacked run that had
    one) when honest0 reaches `newcomer_at_round`: the clean run then has the same learners."""
    honest_args = [*RUN, "--max-rounds", str(rounds), "--linger", "900"]
    if pace_s > 0:  # the same pace in the clean and the attacked run: equal rounds, equal tokens
        honest_args += ["--emulated-step-s", str(pace_s)]
    children: list[ChildProcess] = []
    honest: list[ChildProcess] = []

    def launch(name: str, *extra: str) -> ChildProcess:
        node = node_process(
            name, *honest_args, *extra, home=workdir / name, max_open_files=MAX_OPEN_FILES
        )
        children.append(node)
        honest.append(node)
        return node.start()

    rss = RssSampler(honest)
    try:
        with rss:
            first = launch("honest0")
            maddr = first.wait_listening(START_S)[0]
            launch("honest1", "--peers", maddr).wait_listening(START_S)
            adversary, newcomer_round = None, None
            if newcomer_at_round is not None:
                first.wait_for(
                    lambda e: e.get("event") == "round_done" and e["round"] >= newcomer_at_round,
                    START_S + 10 * rounds,
                    f"honest0 reaching round {newcomer_at_round}",
                )
                launch(*NEWCOMER, "--peers", maddr)
                newcomer_round = newcomer_at_round
            if attacks:
                adversary = ChildProcess(
                    "adversary",
                    python_module(
                        "bench.adversary", "--peers", maddr, "--home", str(workdir / "adversary"),
                        "--attacks", ",".join(attacks), "--sybils", str(sybils),
                        "--settle", str(settle_s), "--", *RUN,
                    ),
                    home=workdir / "adversary",
                )  # fmt: skip
                children.append(adversary)
                adversary.start()
                newcomer_round = _follow_adversary(
                    adversary, launch, first, maddr, timeout_s=START_S + 60 * len(attacks)
                )
            for node in honest:
                with contextlib.suppress(WaitError):  # a crashed node is reported, not raised
                    node.wait_event("lingering", START_S + 10 * rounds)
            result = RunResult(honest, adversary, rss, newcomer_round=newcomer_round)
            result.crashed = [n.name for n in honest if not n.of("lingering")]
            if adversary is not None:
                result.attacks = adversary.of("attack")
            for node in honest:
                node.stop(30)
            return result
    finally:
        reap_all(children)
        if events_dir is not None:
            save_events(children, events_dir / workdir.name)


def _follow_adversary(
    adversary: ChildProcess, launch: Any, first: ChildProcess, maddr: str, timeout_s: float
) -> int | None:
    """Until the adversary is done; a newcomer joins when it serves a poisoned state. The
    round honest0 had reached then (None: no newcomer)."""
    newcomer_round: int | None = None

    def step(event: dict[str, Any]) -> bool:
        nonlocal newcomer_round
        if event.get("event") == "poison_ready" and newcomer_round is None:
            newcomer_round = max((e["round"] for e in first.of("round_done")), default=0)
            launch(*NEWCOMER, "--peers", maddr)
        return event.get("event") == "done"

    try:
        adversary.wait_for(step, timeout_s, "the adversary finishing its attacks")
    except WaitError as exc:  # report the classes that ran; the rows show which did not
        print(f"adversary did not finish: {str(exc).splitlines()[0]}", file=sys.stderr)
    return newcomer_round


def rows_of(result: RunResult, clean: RunResult) -> list[dict[str, Any]]:
    curves = [clean.val_curve(n) for n in clean.pair]
    rows = []
    for attack in result.attacks:
        ended = attack["ended_at"]
        ratios, advanced, peers = [], [], [0]  # peers alive as the honest rounds saw them
        learners: list[int] = []  # the M each honest update was sized by, where it was merged
        honest_ids = {n.peer_id for n in result.honest}
        for i, node in enumerate(result.pair):
            round_, val = result.at(node, ended)
            clean_val = curves[i].get(round_)
            if val is not None and clean_val:
                ratios.append(val / clean_val)
            start = attack["started_at"]
            window = [e for e in node.of("round_done") if start <= e["time"] <= ended]
            advanced.append(len(window))
            peers += [e["peers_alive"] for e in window]
            learners += [
                e["learners"]
                for e in node.of("update_merged")
                if start <= e["time"] <= ended and e["author"] in honest_ids
            ]
        rows.append(
            {
                "attack": attack["attack"],
                "sent": attack["sent"],
                "rejected": sum(attack["rejected"].values()),
                "reasons": attack["rejected"],
                "rounds_advanced": min(advanced, default=0),
                "loss_ratio": round(max(ratios), 4) if ratios else None,
                "peak_rss_mb": round(result.rss.peak_at(ended), 1),
                "max_fds": result.rss.max_fds(attack["started_at"], ended),
                "max_peers_alive": max(peers),
                "min_peers_alive": min(peers[1:], default=None),
                "learners": [min(learners), max(learners)] if learners else None,
                "replicas_agree": _replicas_agree(attack, honest_ids),
                "error": attack["error"],
            }
        )
        if attack["attack"] == "poisoned_state":
            rows[-1]["newcomer"] = newcomer_outcome(result)
    return rows


def _replicas_agree(attack: dict[str, Any], honest_ids: set[str]) -> bool | None:
    """Whether the honest nodes reported one applied set when the class ended (for
    equivocation: that they settled the id the same way)."""
    digests = {d for p, d in attack.get("digests", {}).items() if p in honest_ids}
    return len(digests) == 1 if digests else None


def newcomer_outcome(result: RunResult) -> dict[str, Any]:
    """Whose state the newcomer loaded, and the donors it refused."""
    newcomer = next((n for n in result.honest if n.name == "newcomer"), None)
    if newcomer is None:
        return {"started": False}
    downloaded = newcomer.of("state_downloaded")
    adversary = result.adversary.of("ready")[0]["peer_id"] if result.adversary else None
    donor = downloaded[0]["peer_id"] if downloaded else None
    return {
        "started": True,
        "donor": "adversary" if donor is not None and donor == adversary else donor and "honest",
        "refused_donors": sum(
            e.get("reason") == "bad_state" for e in newcomer.of("update_rejected")
        ),
    }


def final_ratio(result: RunResult, clean: RunResult) -> float | None:
    """The pair's worst ratio at the last round both runs reached (the newcomer trains a few
    rounds of its own numbering: not compared)."""
    ratios = []
    for node, base in zip(result.pair, clean.pair, strict=True):
        mine, theirs = result.val_curve(node), clean.val_curve(base)
        common = sorted(set(mine) & set(theirs))
        if common:
            ratios.append(mine[common[-1]] / theirs[common[-1]])
    return round(max(ratios), 4) if ratios else None


def print_row(row: dict[str, Any]) -> None:
    reasons = ", ".join(f"{r}={n}" for r, n in sorted(row["reasons"].items())) or "-"
    ratio = "-" if row["loss_ratio"] is None else f"{row['loss_ratio']:.3f}"
    if row.get("learners"):
        reasons += f"; M {row['learners'][0]}-{row['learners'][1]}"
    if row.get("replicas_agree") is False:
        reasons += "; applied sets differ"
    if "newcomer" in row:
        reasons += f"; newcomer: {row['newcomer']}"
    print(
        f"{row['attack']:<18} sent {row['sent']:>5}  rejected {row['rejected']:>5}  "
        f"rounds +{row['rounds_advanced']:<3} loss x{ratio:<6} rss {row['peak_rss_mb']:>6.0f} MB"
        f" fds {row['max_fds']:>4} peers {row['min_peers_alive']}-{row['max_peers_alive']}"
        f"  {reasons}" + (f"  ERROR {row['error']}" if row["error"] else ""),
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--rounds", type=int, default=40, help="rounds each honest node trains")
    parser.add_argument("--sybils", type=int, default=1000)
    parser.add_argument("--settle", type=float, default=2.0)
    parser.add_argument("--separate", action="store_true", help="one attacked run per class")
    parser.add_argument(
        "--pace",
        type=float,
        default=0.5,
        help="seconds per honest inner step (emulated, both runs): 40 rounds of 5 steps last "
        "~100 s, so every class runs while the honest nodes train; 0: full speed",
    )
    parser.add_argument(
        "--events-dir", type=Path, help="keep every process's JSON events here, one file each"
    )
    args = parser.parse_args(argv)
    attacks = [a for a in args.attacks.split(",") if a]
    if unknown := sorted(set(attacks) - set(ATTACKS)):
        parser.error(f"unknown attacks {unknown}; choose from {', '.join(ATTACKS)}")
    with tempfile.TemporaryDirectory(prefix="diloco-attack-") as tmp:
        work = Path(tmp)
        run = {"sybils": args.sybils, "settle_s": args.settle, "pace_s": args.pace}
        groups = [[a] for a in attacks] if args.separate else [attacks]
        # The attacked runs first: a clean run gets a newcomer at the round the attacked run's
        # joined (poisoned_state), so both compare the same learners.
        attacked_runs = [
            run_swarm(work / f"attacked{i}", args.rounds, group, **run, events_dir=args.events_dir)
            for i, group in enumerate(groups)
        ]
        cleans: dict[int | None, RunResult] = {}
        for attacked in attacked_runs:
            key = attacked.newcomer_round
            if key not in cleans:
                name = "clean" if key is None else f"clean-newcomer{key}"
                cleans[key] = run_swarm(
                    work / name, args.rounds, [], **run, events_dir=args.events_dir,
                    newcomer_at_round=key,
                )  # fmt: skip
        clean_val: list[float | None] = []
        for key, clean in cleans.items():
            clean_val = [clean.val_curve(n).get(args.rounds) for n in clean.pair]
            joined = "" if key is None else f", newcomer at round {key}"
            print(
                f"clean run{joined}: {args.rounds} rounds, final val loss {clean_val}", flush=True
            )
        rows: list[dict[str, Any]] = []
        crashed: list[str] = []
        ratios: list[float | None] = []
        attacked_val: list[list[float | None]] = []
        for i, attacked in enumerate(attacked_runs):
            clean = cleans[attacked.newcomer_round]
            group_rows = rows_of(attacked, clean)
            if args.separate:
                for row in group_rows:
                    row["loss_ratio"] = final_ratio(attacked, clean)
            for row in group_rows:
                print_row(row)
            rows += group_rows
            crashed += attacked.crashed
            ratios.append(final_ratio(attacked, clean))
            attacked_val.append([attacked.val_curve(n).get(args.rounds) for n in attacked.pair])
            clean_val = [clean.val_curve(n).get(args.rounds) for n in clean.pair]
            print(
                f"attacked run {i}: final val loss {attacked_val[-1]} (clean {clean_val}), "
                f"ratio {ratios[-1]}",
                flush=True,
            )
    known = [r for r in ratios if r is not None]
    idle = [row["attack"] for row in rows if row["rounds_advanced"] == 0]
    if idle:
        print(f"ran after the honest nodes stopped training: {idle} (raise --pace)", flush=True)
    summary = {
        "rows": rows,
        "clean_val_loss": clean_val,
        "newcomer_rounds": [r.newcomer_round for r in attacked_runs],
        "attacked_val_loss": attacked_val,
        "final_loss_ratio": max(known) if known else None,
        "within_tolerance": bool(known) and max(known) <= 1 + LOSS_TOLERANCE,
        "classes_after_training": idle,
        "honest_crashed": crashed,
        "rounds": args.rounds,
        "pace_s": args.pace,
    }
    print(f"final val loss ratio to the clean run: {summary['final_loss_ratio']}", flush=True)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
