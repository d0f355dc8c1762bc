"""A newcomer's first round: the default `diloco-node join` on this machine, from the
command's start to its first published update.

    python -m bench.first_round                  # the default join (what the README says)
    python -m bench.first_round --timeout 600    # a slower machine

The node runs with every default (model, inner steps, data, swarm, dashboard) but JSON
events, in a fresh HOME; it is stopped once its first round is published. Target: within
90 s on a laptop's CPU. The final line is JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from bench.procs import ChildProcess, python_module, reap_all

TARGET_S = 90.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=900, help="bound on the wait, seconds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="first-round-") as home:
        node = ChildProcess(
            "newcomer", python_module("node", "join", "--log-format", "json"), home=Path(home)
        )
        try:
            figures = measure(node.start(), args.timeout)
        finally:
            node.stop()
            reap_all([node])
    print(json.dumps(figures))


def measure(node: ChildProcess, timeout_s: float) -> dict[str, object]:
    """Seconds from the command's start to its events: started, first round published."""
    first_round = node.wait_event("round_done", timeout_s)
    started = node.of("started")[0]
    dashboards = node.of("dashboard")
    seconds = round(first_round["time"] - node.started_at, 1)
    return {
        "benchmark": "first_round",
        "model": started["model"],
        "device": started["device"],
        "inner_steps": first_round["planned_steps"],
        "seconds_to_started": round(started["time"] - node.started_at, 1),
        "seconds_to_first_publish": seconds,
        "round_s": first_round["round_s"],
        "first_round_loss": first_round["loss"],
        "published_seq": first_round["seq"],
        "dashboard_url": dashboards[0]["url"] if dashboards else None,
        "target_s": TARGET_S,
        "within_target": seconds <= TARGET_S,
    }


if __name__ == "__main__":
    main()
