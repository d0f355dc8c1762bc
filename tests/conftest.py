"""Shared fixtures: isolated identity and checkpoint paths, JSON-event runs of the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from xdist.remote import Producer
from xdist.scheduler import LoadGroupScheduling
from xdist.workermanage import WorkerController

from tests.prepare import prepare

REPO = Path(__file__).resolve().parents[1]

# Property tests that name no example count of their own run 50 examples (hypothesis's default
# is 100) and have no per-example deadline: the suite runs on a loaded 2-core CI machine, where a
# slow example is load, not a bug. HYPOTHESIS_PROFILE=thorough restores hypothesis's defaults
# (a local hunt for counterexamples); a test's own @settings(max_examples=...) wins in both.
settings.register_profile("suite", max_examples=50, deadline=None)
settings.register_profile("thorough", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "suite"))

# One torch thread in the test process, whatever order the tests run in (tests/bench's
# test_wire and test_robust_replay set it for themselves, so the suite's later tests used to
# run with one thread or two depending on what ran first). On a loaded 2-core machine two
# threads make the small tensor ops of the unit tests far slower: a 1000x32 sketch projection
# took 20-26 ms with two against 0.2-0.3 ms with one (load 9-13). Node processes the tests
# start set their own (--threads).
torch.set_num_threads(1)


# Before any worker starts, the controller compiles the project's sources and writes pytest's
# assertion-rewritten test modules, on every core (tests/prepare.py: with
# PYTHONDONTWRITEBYTECODE=1 every process the suite starts compiled ~300 modules again, and each
# worker rewrote ~260 test modules while collecting; docs/testing.md, sessions 28-29).
COMPILED = ("node", "dht", "merge", "dashboard", "bench", "tests")


def compile_sources(*, rewrite_asserts: bool = False) -> bool:
    """Write the missing or stale .pyc of every module under COMPILED (and, with
    `rewrite_asserts`, every test module's rewritten one); False on a file that does not compile
    (its import then fails as it would have)."""
    return prepare(REPO, COMPILED, "tests", rewrite_asserts=rewrite_asserts)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the controller: before its xdist workers start
        workers = bool(getattr(config.option, "numprocesses", None))  # -n 0: pytest's own way
        hook = bool(config.getini("enable_assertion_pass_hook"))
        plain = config.getoption("assertmode") != "rewrite"
        compile_sources(rewrite_asserts=workers and not hook and not plain)


@pytest.fixture
def node_home(tmp_path: Path) -> Path:
    """A private ~/.diloco for one test: identity key and checkpoints never touch the real home."""
    home = tmp_path / "home"
    home.mkdir()
    return home


def run_cli(
    args: list[str], *, home: Path, timeout_s: float = 180
) -> tuple[int, list[dict[str, Any]], str]:
    """Run `diloco-node ARGS` in a child process; returns (exit code, JSON events, stderr)."""
    env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "node", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, events, proc.stderr


# Two pytest-xdist workers (pyproject's addopts: `-n 2 --dist loadgroup`) and three groups,
# each run whole by one worker (docs/testing.md, "Where the suite's time goes"):
# - "processes": the swarm tests (real node processes talking to each other, the `swarm`
#   marker, tests/swarm, less those marked `lone`), one after another on one worker as
#   without xdist, so no two swarms ever share the machine; they are the suite's wall time;
# - "single": the other tests outside tests/unit (CLI runs, a lone node, the dashboard app,
#   the benches' wiring, the docs), on the other worker first, at normal priority;
# - "beside": light two-node swarm tests (the `beside` marker) whose assertions were shown to
#   hold with another swarm test running (docs/testing.md, sessions 25-26), on that worker after
#   the single ones, at normal priority: the swarm worker is the suite's wall time, the other
#   one idled its last ~270 s (CI of session 24);
# - "unit": the unit tests, on that worker after them, which then lowers its own priority to
#   the lowest, so they take only the CPU the node processes leave idle (waits for timers,
#   paced steps) and never slow a real-process test's timing. Each unit test file is a work unit
#   of its own (`unit:tests/unit/test_x.py`), handed to whichever worker asks next: once the swarm
#   worker is done it takes unit files too (in CI of session 28 it ended 88 s before the other,
#   which ran the unit tests left alone on one core).
# loadgroup would queue the groups by size (unit, single, processes) and so start the swarm
# tests only once a worker had finished the single ones; GroupsInOrder queues them in
# GROUP_ORDER: the swarm tests start at once, and the unit tests come after the single ones
# on their worker (a niceness is only ever raised, which needs no privilege).
PROCESS_GROUP = "processes"
SINGLE_GROUP = "single"
BESIDE_GROUP = "beside"
UNIT_GROUP = "unit"
GROUP_ORDER = (SINGLE_GROUP, PROCESS_GROUP, BESIDE_GROUP, UNIT_GROUP)
UNIT_TESTS = REPO / "tests" / "unit"
SWARM_TESTS = REPO / "tests" / "swarm"
UNIT_NICENESS = 19


def group_of(item: pytest.Item) -> str:
    """The xdist group `item` runs in (see above)."""
    if UNIT_TESTS in item.path.parents:
        return UNIT_GROUP
    if item.get_closest_marker("lone"):
        return SINGLE_GROUP
    if item.get_closest_marker("beside"):
        return BESIDE_GROUP
    if SWARM_TESTS in item.path.parents or item.get_closest_marker("swarm"):
        return PROCESS_GROUP
    return SINGLE_GROUP


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group_of(item)))


def work_unit(nodeid: str, group: str) -> str:
    """What xdist hands a worker at once for a test of `group`: the group, or a unit test's file."""
    return f"{UNIT_GROUP}:{nodeid.split('::', 1)[0]}" if group == UNIT_GROUP else group


def rank(unit: str) -> int:
    """A work unit's place in GROUP_ORDER (after every group there: one of no group)."""
    group = unit.split(":", 1)[0]
    return GROUP_ORDER.index(group) if group in GROUP_ORDER else len(GROUP_ORDER)


def next_group(queued: Iterable[str]) -> str | None:
    """Of the work units still queued, the first of the group GROUP_ORDER hands out first (the
    unit files in xdist's order, most tests first); None: none queued."""
    return min(queued, key=rank, default=None)


class GroupsInOrder(LoadGroupScheduling):
    """loadgroup, handing out the groups in GROUP_ORDER to whichever worker asks next, the unit
    tests one file at a time."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid, super()._split_scope(nodeid))

    def _assign_work_unit(self, node: WorkerController) -> None:
        first = next_group(self.workqueue)
        if first is not None:
            self.workqueue.move_to_end(first, last=False)
        super()._assign_work_unit(node)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> GroupsInOrder | None:
    return GroupsInOrder(config, log) if config.getoption("dist") == "loadgroup" else None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") and UNIT_TESTS in item.path.parents:
        os.setpriority(os.PRIO_PROCESS, 0, UNIT_NICENESS)  # the same value each time: no-op
