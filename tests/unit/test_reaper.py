"""A killed node leaves no process behind; a clean shutdown leaves no watchdog behind.

Real processes: a stand-in node (a python child of the test) starts the reaper and a long
sleeping child, the way a node starts its DHT process. Every wait is bounded and every process
is killed in a finally, whatever the outcome.
"""

from __future__ import annotations

import contextlib
import select
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from dht.reaper import OrphanReaper, ReaperError

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]
STAND_IN_NODE = """
import subprocess, sys, time
from dht.reaper import OrphanReaper

reaper = OrphanReaper()
reaper.start()
watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
reaper.watch(watched.pid)
print(watched.pid, reaper.watchdog_pid, flush=True)
time.sleep(600)
"""
PDEATHSIG_NODE = """
import os, subprocess, sys, time
from dht.reaper import set_parent_death_signal

me = os.getpid()
child = subprocess.Popen(
    [sys.executable, "-c", "import time; time.sleep(600)"],
    preexec_fn=lambda: set_parent_death_signal(expected_parent=me),
)
print(child.pid, flush=True)
time.sleep(600)
"""


def _gone_within(procs: list[psutil.Process], timeout_s: float) -> list[int]:
    """Pids of the processes still running (zombies excluded) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p.pid for p in procs if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            if proc.is_running():
                proc.kill()


@contextlib.contextmanager
def _stand_in_node(script: str) -> Iterator[tuple[subprocess.Popen[str], list[psutil.Process]]]:
    """A python process running `script`; yields it and the children whose pids it prints."""
    node = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    procs = [psutil.Process(node.pid)]
    try:
        assert node.stdout is not None
        ready, _, _ = select.select([node.stdout], [], [], 20)
        assert ready, "the stand-in node printed nothing within 20 s"
        for pid in node.stdout.readline().split():
            procs.append(psutil.Process(int(pid)))  # one by one: each is killed in finally
        assert procs[1:], "the stand-in node exited before printing its pids"
        yield node, procs[1:]
    finally:
        _kill_all(procs)
        node.wait(timeout=5)
        if node.stdout is not None:
            node.stdout.close()


def test_sigkilled_node_leaves_no_orphans() -> None:
    with _stand_in_node(STAND_IN_NODE) as (node, children):
        node.kill()
        node.wait(timeout=5)
        assert _gone_within(children, 5.0) == [], "the watched child or the watchdog survived"


def test_parent_death_signal_kills_a_child_whose_parent_dies() -> None:
    with _stand_in_node(PDEATHSIG_NODE) as (node, children):
        node.kill()
        node.wait(timeout=5)
        assert _gone_within(children, 5.0) == []


def test_clean_close_leaves_no_watchdog() -> None:
    reaper = OrphanReaper()
    watched = subprocess.Popen(SLEEPER)
    try:
        reaper.start()
        watchdog = psutil.Process(reaper.watchdog_pid or 0)
        reaper.watch(watched.pid)
        watched.kill()
        watched.wait(timeout=5)
        reaper.close()
        assert _gone_within([watchdog], 0.0) == []
    finally:
        reaper.close()
        watched.kill()
        watched.wait(timeout=5)


def test_close_reaps_what_is_still_alive_unless_told_not_to() -> None:
    kept, reaped = subprocess.Popen(SLEEPER), subprocess.Popen(SLEEPER)
    first, second = OrphanReaper(), OrphanReaper()
    try:
        first.start()
        first.watch(kept.pid)
        first.close(kill=False)
        second.start()
        second.watch(reaped.pid)
        second.close(kill=True)
        assert reaped.wait(timeout=5) == -15
        assert kept.poll() is None
    finally:
        first.close()
        second.close()
        for proc in (kept, reaped):
            proc.kill()
            proc.wait(timeout=5)


def test_watch_before_start_is_an_error() -> None:
    with pytest.raises(ReaperError, match="not started"):
        OrphanReaper().watch(1)
