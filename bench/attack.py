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
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

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
from bench.procs import ChildProcess, WaitError, node_process, python_module, reap_all, save_events
from bench.sampling import BackgroundSampler, open_files, rss_bytes
from merge.identity import Identity
from node.allocator import SPEC_ENV, parse_spec

RUN = ["--model", "tiny", "--threads", "1", "--inner-steps", "5", "--eval-batches", "2",
       "--heartbeat-period", "1", "--gap-wait", "10", "--seed", "0"]  # fmt: skip
INNER_STEPS = 5
MAX_OPEN_FILES = 1024
START_S = 180.0
NEWCOMER_ROUNDS = 3
CLEAN_SINCE_ROUND = 4
TAIL_ROUNDS = 8
LAST_EVALUATION_S = 60.0
"""How long a lingering node may take to evaluate its last round before it is read as is."""
TRACEBACK = "Traceback (most recent call last)"
CLASS_GROUPS = {"all": tuple(c for c in ATTACKS if c not in GROUP_CLASSES), "new": PATIENT}


class TracebackCounter(deque[str]):
    """A child's stderr lines (the last `maxlen`), counting every traceback that went by."""

    def __init__(self, maxlen: int) -> None:
        super().__init__(maxlen=maxlen)
        self.tracebacks = 0

    def append(self, line: str) -> None:
        self.tracebacks += TRACEBACK in line
        super().append(line)


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process and its descendants have used so far (its p2pd
    and DHT processes among them; children it has reaped counted too), or None when it is
    gone."""
    try:
        root = psutil.Process(pid)
        times = root.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child_times = child.cpu_times()
                total += child_times.user + child_times.system
        return total
    except psutil.Error:
        return None


class Sampler(BackgroundSampler):
    """RSS and open files of each honest node's main process, once a second, with the time
    (a node that has exited, or whose figures cannot be read, is left out of that sample);
    and the CPU seconds of every child's process tree (`cpu`: the adversary's too), so that
    what an adversary costs the machine's cores can be told from what it does to the
    protocol."""

    def __init__(self, nodes: list[ChildProcess], children: list[ChildProcess]) -> None:
        super().__init__(period_s=1.0)
        self.nodes = nodes
        self.children = children
        self.samples: list[tuple[float, dict[str, tuple[float, int]]]] = []
        self.cpu: dict[str, list[tuple[float, float]]] = {}

    def sample(self) -> None:
        figures: dict[str, tuple[float, int]] = {}
        for node in [n for n in list(self.nodes) if n.alive()]:
            rss, files = rss_bytes(node.pid), open_files(node.pid)
            if rss is not None and files is not None:
                figures[node.name] = (rss / 2**20, files)
        now = time.time()
        self.samples.append((now, figures))
        for child in [c for c in list(self.children) if c.alive()]:
            cpu = tree_cpu_s(child.pid)
            if cpu is not None:
                self.cpu.setdefault(child.name, []).append((now, cpu))

    def cpu_s(self, since: float, until: float) -> dict[str, float]:
        """Each child's CPU seconds between `since` and `until` (its samples within them)."""
        used = {}
        for name, samples in self.cpu.items():
            within = [cpu for t, cpu in samples if since <= t <= until]
            if within:
                used[name] = round(max(within) - min(within), 1)
        return used

    def rss_growth_mb(self, since: float, names: list[str]) -> float:
        """The most any of `names` rose above its last RSS sample before `since` (a node that
        starts later, the newcomer, grows as it loads: not counted)."""
        before: dict[str, float] = {}
        growth = 0.0
        for t, sample in self.samples:
            for name, (rss, _) in sample.items():
                if name not in names:
                    continue
                if t <= since or name not in before:
                    before[name] = rss
                else:
                    growth = max(growth, rss - before[name])
        return growth

    def peak_mb(self, name: str) -> float:
        return max((s[name][0] for _, s in self.samples if name in s), default=0.0)

    def max_open_files(self, since: float) -> int:
        return max((f for t, s in self.samples if t >= since - 1 for _, f in s.values()), default=0)


@dataclass
class Swarm:
    """One run's processes: the honest pair, the newcomer where one joins, the adversary."""

    workdir: Path
    honest_args: list[str]
    keys: dict[str, Path]
    allow_file: Path | None
    honest: list[ChildProcess] = field(default_factory=list)
    children: list[ChildProcess] = field(default_factory=list)
    adversary: ChildProcess | None = None
    newcomer_round: int | None = None

    def launch(self, name: str, *extra: str) -> ChildProcess:
        home = self.workdir / name
        home.mkdir(parents=True, exist_ok=True)
        # A copy per run: the node keeps its seq ledger beside its key, so each run's seqs
        # start at 1 as with a fresh key.
        key = Path(shutil.copy(self.keys[name], home / "id.key"))
        identity = ["--identity", str(key)]
        if self.allow_file is not None:
            identity += ["--allow-keys", str(self.allow_file)]
        node = node_process(
            name, *self.honest_args, *identity, *extra, home=home, max_open_files=MAX_OPEN_FILES
        )
        node.stderr = TracebackCounter(node.stderr.maxlen or 400)
        self.children.append(node)
        self.honest.append(node)
        return node.start()

    @property
    def pair(self) -> list[ChildProcess]:
        return [n for n in self.honest if n.name != "newcomer"]

    @property
    def newcomer(self) -> ChildProcess | None:
        return next((n for n in self.honest if n.name == "newcomer"), None)


HONEST_NAMES = ("honest0", "honest1", "newcomer")


def honest_keys(folder: Path) -> dict[str, Path]:
    """One key file per honest node name, made once per bench invocation and given to that
    node in every run (--identity, a copy in the run's home): a node's data order is seeded
    by its peer id (node.builders: RUN_ID/PEER_ID), so clean and attacked runs see the same
    batches and their ratio measures the adversary, not two different samples of the data."""
    keys = {}
    for name in HONEST_NAMES:
        keys[name] = folder / f"{name}.key"
        Identity.generate().save(keys[name])
    return keys


def permissioned(workdir: Path, keys: dict[str, Path]) -> Path:
    """An allow list naming the honest nodes' keys only."""
    ids = [Identity.load(keys[name]).peer_id for name in HONEST_NAMES]
    allow = workdir / "allow.toml"
    allow.write_text('"honest" = [' + ", ".join(f'"{p}"' for p in ids) + "]\n")
    return allow


@dataclass(frozen=True, kw_only=True)
class Settings:
    rounds: int
    pace_s: float
    sybils: int
    settle_s: float
    allow_keys: bool
    events_dir: Path | None
    keys: dict[str, Path]

    @property
    def training_s(self) -> float:
        return self.rounds * INNER_STEPS * max(self.pace_s, 0.1)

    @property
    def newcomer_at(self) -> int:
        return max(self.rounds // 2, 1)


def run_swarm(workdir: Path, settings: Settings, attack: str | None, newcomer: bool) -> RunFigures:
    """One run of the honest pair, attacked by `attack` (None: a clean run); with `newcomer`,
    a newcomer joins at settings.newcomer_at (attacked: once the poisoner is ready too)."""
    started = time.time()
    honest_args = [*RUN, "--max-rounds", str(settings.rounds), "--linger", "900"]
    if settings.pace_s > 0:  # the same pace in every run: equal rounds, equal tokens
        honest_args += ["--emulated-step-s", str(settings.pace_s)]
    workdir.mkdir(parents=True, exist_ok=True)
    allow = permissioned(workdir, settings.keys) if settings.allow_keys else None
    swarm = Swarm(workdir, honest_args, settings.keys, allow)
    sampler = Sampler(swarm.honest, swarm.children)
    try:
        with sampler:
            first = swarm.launch("honest0")
            maddr = first.wait_listening(START_S)[0]
            swarm.launch("honest1", "--peers", maddr).wait_listening(START_S)
            if attack is not None:
                start_adversary(swarm, settings, attack, maddr)
            if newcomer:
                join_newcomer(swarm, settings, maddr)
            if swarm.adversary is not None:
                with contextlib.suppress(WaitError):  # the rows show a class that did not end
                    swarm.adversary.wait_event("done", START_S + 2 * settings.training_s + 300)
            for node in swarm.honest:
                with contextlib.suppress(WaitError):  # a crashed node is reported, not raised
                    node.wait_event("lingering", START_S + 10 * settings.rounds)
            for node in swarm.pair:
                wait_last_evaluation(node, settings.rounds, LAST_EVALUATION_S)
            figures = measure(swarm, sampler, attack, started)
            for node in swarm.honest:
                node.stop(30)
            return figures
    finally:
        reap_all(swarm.children)
        if settings.events_dir is not None:
            save_events(swarm.children, settings.events_dir / workdir.name)


def start_adversary(swarm: Swarm, settings: Settings, attack: str, maddr: str) -> None:
    home = swarm.workdir / "adversary"
    patient = [
        "--duration",
        str(2 * settings.training_s + 60),
        "--until-round",
        str(settings.rounds - 1),
    ]
    argv = python_module(
        "bench.adversary", "--peers", maddr, "--home", str(home), "--attacks", attack,
        "--sybils", str(settings.sybils), "--settle", str(settings.settle_s), *patient,
        "--", *RUN,
    )  # fmt: skip
    swarm.adversary = ChildProcess("adversary", argv, home=home)
    swarm.children.append(swarm.adversary)
    swarm.adversary.start()


def join_newcomer(swarm: Swarm, settings: Settings, maddr: str) -> None:
    """At settings.newcomer_at rounds of honest0, and (attacked) once the poisoner is ready."""
    first = swarm.honest[0]
    if swarm.adversary is not None:
        swarm.adversary.wait_event("poison_ready", START_S + settings.training_s)
    first.wait_for(
        lambda e: e.get("event") == "round_done" and e["round"] >= settings.newcomer_at,
        START_S + 10 * settings.rounds,
        f"honest0 reaching round {settings.newcomer_at}",
    )
    swarm.newcomer_round = max(e["round"] for e in first.of("round_done"))
    swarm.launch("newcomer", "--peers", maddr, "--max-rounds", str(NEWCOMER_ROUNDS))


def measure(swarm: Swarm, sampler: Sampler, attack: str | None, started: float) -> RunFigures:
    events = swarm.adversary.of("attack") if swarm.adversary is not None else []
    event = events[0] if events else {}
    # A clean run's growth is measured from honest0's round CLEAN_SINCE_ROUND on: about when
    # an adversary is ready to start its class, so the two growths compare.
    warm = [e["time"] for e in swarm.honest[0].of("round_done") if e["round"] >= CLEAN_SINCE_ROUND]
    since = event.get("started_at", warm[0] if warm else started)
    ended = event.get("ended_at", time.time())
    honest_ids = {n.peer_id for n in swarm.honest if n.of("listening")}
    newcomer = swarm.newcomer
    figures = RunFigures(
        attack=attack,
        final_val={n.name: last_val(n) for n in swarm.pair},
        newcomer_curve=val_curve(newcomer) if newcomer is not None else {},
        newcomer_round=swarm.newcomer_round,
        rss_growth_mb=sampler.rss_growth_mb(since, [n.name for n in swarm.pair]),
        peak_rss_mb={n.name: sampler.peak_mb(n.name) for n in swarm.pair},
        max_open_files=sampler.max_open_files(since),
        tracebacks=sum(getattr(n.stderr, "tracebacks", 0) for n in swarm.honest),
        crashed=[n.name for n in swarm.honest if not n.of("lingering")],
        counted=event.get("rejected", {}),
        error=event.get("error") if events or swarm.adversary is None else "the class never ended",
        rounds_advanced=min(
            (sum(since <= e["time"] <= ended for e in n.of("round_done")) for n in swarm.pair),
            default=0,
        ),
        strangers_served=sum(stranger_updates(n, honest_ids) for n in swarm.honest),
        cpu_s=sampler.cpu_s(since, ended),
        tail_val={n.name: tail_val(n) for n in swarm.pair},
        learners=sorted(
            {
                e["learners"]
                for n in swarm.pair
                for e in n.of("update_merged")
                if e["author"] in honest_ids and e["time"] >= since
            }
        ),  # fmt: skip
        seconds=time.time() - started,
    )
    if newcomer is not None and attack is not None:
        figures.newcomer = newcomer_outcome(newcomer, swarm.adversary)
    return figures


def val_curve(node: ChildProcess) -> dict[int, float]:
    """Each evaluated round's loss (evaluations run beside training: round_done's val_loss is
    the newest finished by then, often an earlier round's)."""
    return {e["round"]: float(e["val_loss"]) for e in node.of("evaluated") if e.get("val_loss")}


def tail_val(node: ChildProcess, num_rounds: int = TAIL_ROUNDS) -> float | None:
    """The mean val loss of a node's last `num_rounds` evaluated rounds: a run's level read
    over more than its final round's draw (the plateau spikes +-0.3 round to round)."""
    curve = sorted(val_curve(node).items())[-num_rounds:]
    return statistics.fmean(v for _, v in curve) if curve else None


def wait_last_evaluation(node: ChildProcess, rounds: int, timeout_s: float) -> None:
    """Until `node` has evaluated its round `rounds` (at most `timeout_s`; a node that has
    not by then is read as it is). Evaluations run beside training, so a node lingers before
    its last one ends: read at "lingering", honest1's final loss was its round 39's in every
    clean run of flood12 and its round 40's in half the attacked ones."""
    with contextlib.suppress(WaitError):
        node.wait_for(
            lambda e: e.get("event") == "evaluated" and e.get("round", -1) >= rounds,
            timeout_s,
            f"{node.name}'s evaluation of round {rounds}",
        )


def last_val(node: ChildProcess) -> float | None:
    done = sorted((e for e in node.of("evaluated") if e.get("val_loss")), key=lambda e: e["round"])
    return float(done[-1]["val_loss"]) if done else None


def stranger_updates(node: ChildProcess, honest_ids: set[str]) -> int:
    """Updates of keys no honest node holds that `node` fetched or merged."""
    merged = sum(e["author"] not in honest_ids for e in node.of("update_merged"))
    fetched = sum(e["peer_id"] not in honest_ids for e in node.of("update_fetched"))
    return merged + fetched


def newcomer_outcome(newcomer: ChildProcess, adversary: ChildProcess | None) -> dict[str, Any]:
    """Whose state the newcomer loaded, and the donors it refused."""
    downloaded = newcomer.of("state_downloaded")
    ready = adversary.of("ready") if adversary is not None else []
    poisoner = ready[0]["peer_id"] if ready else None
    donor = downloaded[0]["peer_id"] if downloaded else None
    return {
        "donor": None if donor is None else "adversary" if donor == poisoner else "honest",
        "refused_donors": sum(
            e.get("reason") == "bad_state" for e in newcomer.of("update_rejected")
        ),
    }


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
