"""Swarm test harness: real `diloco-node join` processes on 127.0.0.1, reaped whatever happens.

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
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import psutil
import pytest

from tests.conftest import REPO

logger = logging.getLogger(__name__)

Event = dict[str, Any]
STDERR_LINES = 2000
"""Raw stderr lines (and stray stdout lines) kept per node for failure messages."""
TAIL_LINES = 40
"""Lines of that tail quoted in an assertion message."""
POLL_S = 0.25
"""Longest condition-variable wait before re-checking that the node is still running."""
STOP_TIMEOUT_S = 30.0
STDOUT_GRACE_S = 5.0
"""After the main process exits, how long its stdout may stay open before wait_exit returns with
what was read so far. A forked DHT process holds it until the node's reaper has taken it: at most
~3.3 s (dht.reaper's poll, SIGTERM grace, SIGKILL)."""
EXIT_TIMEOUT_S = 5.0
"""How long killed processes get to disappear before they count as survivors."""
SESSION_MARKER = "DILOCO_TEST_SESSION"
"""Set in this session's environment; every process the session starts inherits it."""


class NodeProcess:
    """One `diloco-node join --log-format json` child process and what it has said so far."""

    command = ["join", "--log-format", "json", "--host", "127.0.0.1", "--port", "0"]
    """The subcommand and defaults every launch starts with; later args override them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.home: Path | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._events: list[Event] = []
        self._stderr: deque[str] = deque(maxlen=STDERR_LINES)
        self._cond = threading.Condition()
        self._stdout_closed = False
        self._readers: list[threading.Thread] = []

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, args: list[str], *, home: Path) -> NodeProcess:
        """Launch the node on 127.0.0.1, any free port; later args override those defaults."""
        if self._proc is not None:
            raise AssertionError(f"{self.name} is already started")
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "node", *self.command, *args],
            cwd=REPO,
            env={**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )  # fmt: skip
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._readers = [
            self._spawn_reader(self._proc.stdout, self._on_stdout_line, self._on_stdout_closed),
            self._spawn_reader(self._proc.stderr, self._stderr.append, lambda: None),
        ]
        logger.info("%s: started pid %d: %s", self.name, self.pid, " ".join(args))
        return self

    @property
    def pid(self) -> int:
        return self._popen().pid

    @property
    def pgid(self) -> int:
        """The node's process group: start_new_session makes it equal to the main pid."""
        return self.pid

    def wait_exit(self, timeout_s: float) -> int:
        """The exit code (negative: killed by that signal), once stdout is read to its end."""
        try:
            code = self._popen().wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} did not exit within {timeout_s} s\n{self.stderr_tail()}"
            ) from None
        self._wait_stdout_closed(STDOUT_GRACE_S)
        return code

    def signal(self, sig: int) -> None:
        """Send `sig` to the main process only."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the main process only, like a crash; its children are left to themselves."""
        self.signal(signal.SIGKILL)

    def pause(self) -> None:
        """SIGSTOP the whole process group: the node, its DHT process and p2pd all freeze."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Ctrl+C: SIGINT, then SIGKILL of the group if the node has not exited in time."""
        self.resume()
        self.signal(signal.SIGINT)
        try:
            return self.wait_exit(timeout_s)
        except AssertionError:
            logger.warning("%s ignored SIGINT for %s s; killing its group", self.name, timeout_s)
            self.reap()
            return self._popen().wait(timeout=EXIT_TIMEOUT_S)

    def reap(self) -> None:
        """SIGKILL the whole process group and collect the main process."""
        if self._proc is None:
            return
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=EXIT_TIMEOUT_S)

    def leftover_processes(self, timeout_s: float = EXIT_TIMEOUT_S) -> list[psutil.Process]:
        """Processes of this node (its group, or anything carrying its HOME) still alive after
        waiting up to `timeout_s` for them to go."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [p for p in self._own_processes() if _running(p)]
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.1)

    # -- what the node said ----------------------------------------------------------------------

    def events(self, name: str | None = None) -> list[Event]:
        with self._cond:
            return [e for e in self._events if name is None or e.get("event") == name]

    def wait_for(self, predicate: Callable[[Event], bool], timeout_s: float, what: str) -> Event:
        """The first event (already seen or still to come) that satisfies `predicate`."""
        deadline = time.monotonic() + timeout_s
        checked = 0
        with self._cond:
            while True:
                for event in self._events[checked:]:
                    if predicate(event):
                        return event
                checked = len(self._events)
                remaining = deadline - time.monotonic()
                if self._stdout_closed or remaining <= 0:
                    break
                self._cond.wait(min(remaining, POLL_S))
        status = "timed out" if not self._stdout_closed else f"exited ({self._exit_status()})"
        raise AssertionError(
            f"{self.name}: {what}: {status} after {timeout_s} s\n{self.stderr_tail()}"
        )

    def wait_for_event(self, name: str, timeout_s: float, **fields: Any) -> Event:
        """The first `name` event whose fields include `fields`."""
        return self.wait_for(
            lambda e: e.get("event") == name and all(e.get(k) == v for k, v in fields.items()),
            timeout_s,
            f"waiting for {name} {fields or ''}".rstrip(),
        )

    def wait_listening(self, timeout_s: float) -> list[str]:
        """The full multiaddrs (with /p2p/<peer id>) peers can join through."""
        return list(self.wait_for_event("listening", timeout_s)["maddrs"])

    @property
    def maddrs(self) -> list[str]:
        return list(self._listening()["maddrs"])

    @property
    def peer_id(self) -> str:
        for event in self.events():
            if event.get("event") in ("listening", "started") and "peer_id" in event:
                return str(event["peer_id"])
        raise AssertionError(f"{self.name} has not reported its peer id yet")

    def stderr_tail(self, num_lines: int = TAIL_LINES) -> str:
        with self._cond:
            lines = list(self._stderr)[-num_lines:]
        return f"--- last {len(lines)} stderr lines of {self.name} ---\n" + "\n".join(lines)

    # -- internals -------------------------------------------------------------------------------

    def _popen(self) -> subprocess.Popen[str]:
        if self._proc is None:
            raise AssertionError(f"{self.name} is not started")
        return self._proc

    def _listening(self) -> Event:
        found = self.events("listening")
        if not found:
            raise AssertionError(f"{self.name} has not reported listening; use wait_listening")
        return found[0]

    def _spawn_reader(
        self, stream: IO[str], on_line: Callable[[str], None], on_eof: Callable[[], None]
    ) -> threading.Thread:
        thread = threading.Thread(
            target=self._read, args=(stream, on_line, on_eof), name=self.name, daemon=True
        )
        thread.start()
        return thread

    def _read(
        self, stream: IO[str], on_line: Callable[[str], None], on_eof: Callable[[], None]
    ) -> None:
        """Reader thread: hands each line to `on_line` under the condition, then wakes waiters."""
        with stream:
            for line in stream:
                with self._cond:
                    on_line(line.rstrip("\n"))
                    self._cond.notify_all()
        with self._cond:
            on_eof()
            self._cond.notify_all()

    def _on_stdout_line(self, line: str) -> None:
        """Called with the condition held: JSON events are kept, anything else joins stderr."""
        event = _parse_event(line)
        if event is None:
            self._stderr.append(f"[stdout] {line}")
        else:
            self._events.append(event)

    def _on_stdout_closed(self) -> None:
        self._stdout_closed = True

    def _wait_stdout_closed(self, timeout_s: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._stdout_closed, timeout_s):
                logger.warning("%s exited but its stdout is still held open", self.name)

    def _exit_status(self) -> str:
        # stdout closes a moment before the process can be reaped: wait that moment out.
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._popen().wait(EXIT_TIMEOUT_S)
        code = self._popen().poll()
        return "still running" if code is None else f"exit code {code}"

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def _own_processes(self) -> list[psutil.Process]:
        if self._proc is None or self.home is None:
            return []
        return _processes_of(group=self.pgid, home=str(self.home))


def _parse_event(line: str) -> Event | None:
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    return event if isinstance(event, dict) and "event" in event else None


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _processes_of(*, group: int, home: str) -> list[psutil.Process]:
    """Processes in process group `group` or whose environment has HOME=home."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if proc.pid == os.getpid():
                continue
            if os.getpgid(proc.pid) == group or proc.environ().get("HOME") == home:
                found.append(proc)
    return found


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


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    """`launch(*args, name="node0")` starts a node with HOME tmp_path/name; every node is reaped
    in teardown, and a process of theirs that survives fails the test. Relaunching a name reuses
    its HOME (identity and checkpoints), as a restarted node would."""
    nodes: list[NodeProcess] = []

    def _launch(*args: str, name: str = "node0", home: Path | None = None) -> NodeProcess:
        node = NodeProcess(name)
        nodes.append(node)
        return node.start(list(args), home=home or tmp_path / "homes" / name)

    try:
        yield _launch
    finally:
        _reap_all(nodes)


def _reap_all(nodes: list[NodeProcess]) -> None:
    for node in nodes:
        node.reap()
    survivors = list({p.pid: p for node in nodes for p in node.leftover_processes()}.values())
    if survivors:
        described = _describe(survivors)
        _kill(survivors)
        raise AssertionError(f"processes outlived their node's teardown: {described}")
