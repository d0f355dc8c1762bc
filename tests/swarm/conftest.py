"""Swarm test harness: real `diloco-node join` processes on 127.0.0.1, reaped whatever happens.

The launcher is bench.procs.ChildProcess, the one benchmarks use.

Each node runs in its own process group (so its forked DHT process and p2pd go down with it) and
with a private HOME (so ~/.diloco is its own, and every process it spawns carries that HOME).
The contract relied on: with --log-format json a node writes one JSON object per line on stdout,
each with an "event" field; its logs go to stderr.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from bench.procs import ChildProcess, node_process, save_events
from dht.heartbeat import Heartbeat
from dht.observer import SwarmObserver

logger = logging.getLogger(__name__)

SESSION_MARKER = "DILOCO_TEST_SESSION"
"""Set in this session's environment; every process the session starts inherits it."""

NodeProcess = ChildProcess
"""The one launcher, shared with the benchmarks (bench/procs.py)."""


def _kill(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _describe(procs: list[psutil.Process]) -> str:
    described = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            described.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
    return "; ".join(described)


@pytest.fixture(scope="session")
def swarm_session() -> Iterator[float]:
    """Marks every process this session starts; kills this session's orphans at its end."""
    started = time.time()
    previous = os.environ.get(SESSION_MARKER)
    marker = f"{os.getpid()}-{started}"
    os.environ[SESSION_MARKER] = marker
    try:
        yield started
    finally:
        kill_orphans(marker, since=started)
        if previous is None:
            os.environ.pop(SESSION_MARKER, None)
        else:
            os.environ[SESSION_MARKER] = previous


@pytest.fixture(autouse=True)
def _no_orphans_leak_into_the_next_test(swarm_session: float) -> Iterator[None]:
    yield
    kill_orphans(os.environ[SESSION_MARKER], since=swarm_session)


def kill_orphans(marker: str, *, since: float) -> list[int]:
    """Kill re-parented orphans (parent pid 1: p2pd, a DHT process) this session started.

    Only processes started after `since` and carrying this session's marker in their
    environment, so a concurrent test run on the same machine is left alone.
    """
    orphans = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if (
                proc.ppid() == 1
                and proc.create_time() >= since - 1
                and proc.environ().get(SESSION_MARKER) == marker
            ):
                orphans.append(proc)
    if orphans:
        logger.warning("killing orphaned processes: %s", _describe(orphans))
        _kill(orphans)
    return [p.pid for p in orphans]


EVENTS_DIR = "DILOCO_TEST_EVENTS_DIR"
"""When set, every node's JSON events (with their times) are kept there after each test,
one folder per test: to see where a real-process test's seconds go (docs/testing.md)."""


def _keep_events(nodes: list[NodeProcess], test_name: str) -> None:
    folder = os.environ.get(EVENTS_DIR)
    if folder:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in test_name)
        save_events(nodes, Path(folder) / safe)
        spans = [[n.name, n.started_at, n.exited_at] for n in nodes]
        (Path(folder) / safe / "spans.json").write_text(json.dumps(spans))


TEST_NODE_FLAGS = ("--no-dashboard",)
"""What every node a swarm test launches is given before the test's own flags (which win): no
swarm test reads a node's own dashboard (the browser test reads a standalone one), and building
it beside training (fastapi, uvicorn, its first answers) cost each node ~0.5 s of CPU on an idle
machine, ~3 s under load (node/dashboard_seam.py)."""


@pytest.fixture
def launch(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., NodeProcess]]:
    """`launch(*args, name="node0")` starts a node with HOME tmp_path/name; every node is reaped
    in teardown, and a process of theirs that survives fails the test. Relaunching a name reuses
    its HOME (identity and checkpoints), as a restarted node would. `launch.child(process)`
    starts another ChildProcess (an adversary peer) the same way: reaped, its events kept."""
    nodes: list[NodeProcess] = []

    def _child(node: NodeProcess) -> NodeProcess:
        nodes.append(node)
        return node.start()

    def _launch(*args: str, name: str = "node0", home: Path | None = None) -> NodeProcess:
        argv = (*TEST_NODE_FLAGS, *args)
        return _child(node_process(name, *argv, home=home or tmp_path / "homes" / name))

    _launch.child = _child  # type: ignore[attr-defined]

    try:
        yield _launch
    finally:
        _keep_events(nodes, request.node.nodeid)
        _reap_all(nodes)


def _reap_all(nodes: list[NodeProcess]) -> None:
    for node in nodes:
        node.reap()
    survivors = list({p.pid: p for node in nodes for p in node.leftover_processes()}.values())
    if survivors:
        described = _describe(survivors)
        _kill(survivors)
        raise AssertionError(f"processes outlived their node's teardown: {described}")


def observed_heartbeats(observer: SwarmObserver, run_id: str = "diloco-default") -> list[Heartbeat]:
    """The newest heartbeat of every peer the observer reads under `run_id`, or [] while the
    run's record is not yet found (a DHT get just after joining can miss it: poll again)."""
    return [p.heartbeat for snapshot in observer.snapshot(run_id)[:1] for p in snapshot.peers]
