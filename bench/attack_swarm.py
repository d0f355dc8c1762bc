"""One bench.attack run: the honest pair (a newcomer where one joins) beside the adversary
running one attack class, or alone (a clean run), and the figures read from their events."""

from __future__ import annotations

import contextlib
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.attack_rows import RunFigures
from bench.attack_sampler import Sampler, TracebackCounter
from bench.procs import ChildProcess, WaitError, node_process, python_module, reap_all, save_events
from merge.identity import Identity

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
