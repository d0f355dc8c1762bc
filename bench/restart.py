"""Restart cost: from process start to the first inner step of a node that has a checkpoint
and a live peer, broken down by the `startup_phase` events the node emits.

    python -m bench.restart                    # tiny, 3 restarts against one live peer
    python -m bench.restart --restarts 5

A peer trains throughout; the measured node first trains one round and stops (its checkpoint),
then is started `--restarts` times, each time stopped (SIGINT, a clean save) once it has
entered the swarm and checked its state, which it does beside training. `import_torch_s` is
`python -c "import torch"` timed in the same run: the floor any node pays. The final line is
JSON: start_to_first_step_s, import_torch_s, their ratio, each phase's median seconds (a
phase is the time since the previous phase's event), the phases beside training after the
first step (hivemind, p2pd, the DHT, the state check) and partial_save_s (how often a round
in progress is saved, the median gap between the live peer's background saves in this run,
at most `PARTIAL_SAVE_S`: a kill -9 loses half of it on average). With `--out FILE` it is also
written there; bench.goodput_sim takes its asynchronous rows' recovery from the committed
bench/results/restart.json (`--out bench/results/restart.json` replaces it: do that only with
figures worth citing) or from `--restart-figures FILE`.

    python -m bench.restart --out /tmp/restart.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bytecode import compile_packages
from bench.procs import ChildProcess, Event, cli_flags, node_process, reap_all
from node.persistence import PARTIAL_SAVE_S

START_TIMEOUT_S = 180.0
PHASES = ("imports", "identity_and_locks", "build", "checkpoint_load", "first_batch")
"""On the path to the first inner step, in order (the seconds since the previous one)."""
BESIDE = ("p2pd", "dht_bootstrap", "state_check")
"""Beside training, after the first inner step: hivemind's imports and p2pd (`p2pd`), the DHT
member and the run check (`dht_bootstrap`), the state check (seconds since the previous one,
the first since `first_batch`). A node before issue 23's second pass ran the first two on
the path, between checkpoint_load and first_batch."""
TARGET_RATIO = 1.5


def import_torch_s() -> float:
    started = time.time()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=120)
    return time.time() - started


def phases(events: list[Event], started_at: float) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds of each start-up phase from process start to the `first_batch` phase event,
    and of each phase after it (beside training)."""
    marks = [e for e in events if e["event"] == "startup_phase"]
    path: dict[str, float] = {}
    beside: dict[str, float] = {}
    durations, previous = path, started_at
    for mark in marks:
        durations[mark["name"]] = round(mark["time"] - previous, 3)
        previous = mark["time"]
        if mark["name"] == "first_batch":
            durations = beside
    return path, beside


def first_step_at(child: ChildProcess) -> float:
    event = child.wait_for(
        lambda e: e["event"] == "startup_phase" and e.get("name") == "first_batch",
        START_TIMEOUT_S,
        "the first inner step",
    )
    return float(event["time"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--restarts", type=int, default=3)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write the final JSON line to this file (bench.goodput_sim --restart-figures "
        "reads it); without it nothing is written",
    )
    args = parser.parse_args()
    common = cli_flags(
        run_id="bench-restart", model=args.model, inner_steps=args.inner_steps, threads=1
    )
    compile_packages()  # as installed: no node compiles its modules at each start
    children: list[ChildProcess] = []
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        try:
            peer = node_process("peer", *common, "--identity", str(home / "peer.key"), home=home)
            children.append(peer.start())
            peers = cli_flags(peers=peer.wait_listening(START_TIMEOUT_S)[0])
            own = [*common, *peers, "--identity", str(home / "node.key")]
            own += cli_flags(checkpoint_dir=home / "ckpt")
            first = node_process("node", *own, "--max-rounds", "1", home=home)
            children.append(first.start())
            first.wait_exit(START_TIMEOUT_S)
            runs, floors = [], []
            for _ in range(args.restarts):
                floors.append(import_torch_s())
                child = node_process("node", *own, home=home)
                started_at = time.time()
                children.append(child.start())
                first_step_at(child)
                child.wait_for(
                    lambda e: e["event"] == "startup_phase" and e.get("name") == "state_check",
                    START_TIMEOUT_S,
                    "the state check beside training",
                )
                runs.append(phases(child.events, started_at))
                child.stop()
        finally:
            reap_all(children)
        save_s = partial_save_s(peer.events)
    totals = [sum(path.values()) for path, _ in runs]
    floor = statistics.median(floors)
    total = statistics.median(totals)
    line = json.dumps(
        {
            "benchmark": "restart",
            "model": args.model,
            "restarts": args.restarts,
            "start_to_first_step_s": round(total, 3),
            "start_to_first_step_each_s": [round(t, 3) for t in totals],
            "import_torch_s": round(floor, 3),
            "ratio": round(total / floor, 2),
            "target_ratio": TARGET_RATIO,
            "phases": _medians([path for path, _ in runs], PHASES),
            "beside_training": _medians([beside for _, beside in runs], BESIDE),
            "swarm_entered_after_first_step_s": round(
                statistics.median(sum(beside.values()) for _, beside in runs), 3
            ),
            "partial_save_s": save_s,
            "partial_save_max_s": PARTIAL_SAVE_S,
        }
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(line + "\n")
    print(line)


def partial_save_s(events: list[Event]) -> float:
    """The median seconds between a node's background saves of its round in progress (their
    copies, which a restart resumes); `PARTIAL_SAVE_S`, the bound, if fewer than two."""
    copied = [
        float(e["copied_at"])
        for e in events
        if e["event"] == "checkpoint_saved" and e.get("background") and "copied_at" in e
    ]
    gaps = [b - a for a, b in zip(copied, copied[1:], strict=False)]
    return round(statistics.median(gaps), 3) if gaps else PARTIAL_SAVE_S


def _medians(runs: list[dict[str, float]], names: tuple[str, ...]) -> dict[str, float]:
    return {n: round(statistics.median(r.get(n, 0.0) for r in runs), 3) for n in names}


if __name__ == "__main__":
    main()
