"""`python -m bench.scale --sim --rounds R` (session 28): the simulator's training rounds, so
that 4000 nodes fit in minutes; 0 is refused in one sentence."""

from __future__ import annotations

import subprocess
import sys
from argparse import Namespace

from bench.scale import _sim_config


def _args(**changes: object) -> Namespace:
    values: dict[str, object] = {
        "seed": 0, "wired": False, "scatter": True, "group_size": 0, "balanced": False,
        "bf16_sums": False, "fold_own": False, "fold_own_replicas": 1,
        "whole_past_fold": False, "rounds": 10, "all_gather_own": False,
    }  # fmt: skip
    values.update(changes)
    return Namespace(**values)


def test_the_rounds_reach_the_simulator() -> None:
    assert _sim_config(_args()).rounds == 10
    assert _sim_config(_args(rounds=3)).rounds == 3


def test_no_rounds_is_refused_in_one_sentence() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.scale", "--sim", "--nodes", "8", "--rounds", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "--rounds takes 1 or more, got 0" in done.stderr
