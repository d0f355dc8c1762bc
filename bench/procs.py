"""Child processes for benchmarks: one per node, in its own process group, reaped whatever happens.

A child writes one JSON event per line on stdout (`diloco-node join --log-format json`, or a
baseline worker); each event is kept with the time it was read. The child's whole process group
(its forked DHT process and p2pd included) is what a crash, a freeze or a reap acts on, the way
a machine failure takes all of a node's processes at once.
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
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import psutil

logger = logging.getLogger(__name__)

Event = dict[str, Any]
REPO = Path(__file__).resolve().parents[1]
STDERR_LINES = 400
"""stderr lines kept per child, quoted when a wait fails."""
EXIT_TIMEOUT_S = 10.0
"""How long a signalled child gets to exit before its group is killed."""


class ChildProcess:
    """One child process and the JSON events it has printed so far."""

    def __init__(self, name: str, argv: list[str], *, home: Path, prefix: list[str] | None = None):
        self.name = name
        self.argv = [*(prefix or []), *argv]
        self.home = home
        self.events: list[Event] = []
        self.stderr: deque[str] = deque(maxlen=STDERR_LINES)
        self.started_at = 0.0
        self.exited_at: float | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> ChildProcess:
        self.home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "HOME": str(self.home), "PYTHONUNBUFFERED": "1"}
        self._proc = subprocess.Popen(
            self.argv,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        self.started_at = time.time()
        assert self._proc.stdout is not None and self._proc.stderr is not None
        for stream, on_line in ((self._proc.stdout, self._on_stdout), (self._proc.stderr, None)):
            threading.Thread(target=self._read, args=(stream, on_line), daemon=True).start()
        logger.info("%s: started pid %d", self.name, self._proc.pid)
        return self

    @property
    def pid(self) -> int:
        assert self._proc is not None, f"{self.name} is not started"
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ---- faults ----------------------------------------------------------------------------

    def crash(self) -> None:
        """kill -9 of the whole process group: the node and its DHT process and p2pd."""
        self._signal_group(signal.SIGKILL)
        self._wait(EXIT_TIMEOUT_S)

    def pause(self) -> None:
        self._signal_group(signal.SIGSTOP)

    def renice(self, niceness: int) -> None:
        """Set the CPU niceness of every process in the group (root may lower it)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpriority(os.PRIO_PGRP, self.pid, niceness)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ctrl+C (a clean stop that saves a checkpoint), then SIGKILL of the group if slow."""
        self.interrupt()
        self.finish(timeout_s)

    def interrupt(self) -> None:
        """Send Ctrl+C (SIGINT) to the main process, resuming the group first if frozen."""
        if self.alive():
            self.resume()
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGINT)

    def finish(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the child to exit, then reap its group."""
        if self._proc is not None and not self._wait(timeout_s):
            logger.warning("%s ignored SIGINT for %.0f s; killing its group", self.name, timeout_s)
        self.reap()

    def reap(self) -> None:
        """SIGKILL whatever is left of the group and collect the main process."""
        if self._proc is None:
            return
        self._signal_group(signal.SIGCONT)
        self._signal_group(signal.SIGKILL)
        self._wait(EXIT_TIMEOUT_S)

    def leftovers(self) -> list[psutil.Process]:
        """Live processes of this child: its group, or anything carrying its HOME."""
        if self._proc is None:
            return []
        found = []
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error, OSError):
                if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                if os.getpgid(proc.pid) == self.pid or proc.environ().get("HOME") == str(self.home):
                    found.append(proc)
        return found

    # ---- events ----------------------------------------------------------------------------

    def of(self, name: str) -> list[Event]:
        with self._cond:
            return [e for e in self.events if e.get("event") == name]

    def wait_for(self, predicate: Callable[[Event], bool], timeout_s: float, what: str) -> Event:
        """The first event satisfying `predicate`; raises TimeoutError with the stderr tail."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for event in self.events:
                    if predicate(event):
                        return event
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.25))
        tail = "\n".join(list(self.stderr)[-30:])
        status = "it exited first" if self._closed else f"not seen within {timeout_s:.0f} s"
        raise TimeoutError(f"{self.name}: {what}: {status}\n{tail}")

    def wait_event(self, name: str, timeout_s: float) -> Event:
        return self.wait_for(lambda e: e.get("event") == name, timeout_s, f"waiting for {name}")

    # ---- internals -------------------------------------------------------------------------

    def _read(self, stream: IO[str], on_line: Callable[[str], None] | None) -> None:
        with stream:
            for line in stream:
                with self._cond:
                    (on_line or self.stderr.append)(line.rstrip("\n"))
                    self._cond.notify_all()
        if on_line is not None:
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def _on_stdout(self, line: str) -> None:
        try:
            event = json.loads(line) if line.startswith("{") else None
        except json.JSONDecodeError:
            event = None
        if isinstance(event, dict) and "event" in event:
            event.setdefault("time", time.time())
            self.events.append(event)
        else:
            self.stderr.append(f"[stdout] {line}")

    def _signal_group(self, sig: int) -> None:
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    def _wait(self, timeout_s: float) -> bool:
        assert self._proc is not None
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        if self.exited_at is None:
            self.exited_at = time.time()
        return True


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def cli_flags(**options: object) -> list[str]:
    """`--name value` pairs from keyword arguments; underscores in names become dashes."""
    flags = []
    for name, value in options.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def reap_all(children: list[ChildProcess]) -> list[str]:
    """Kill every child's group and anything left carrying its HOME; describes survivors."""
    for child in children:
        child.reap()
    survivors = []
    for child in children:
        for proc in child.leftovers():
            with contextlib.suppress(psutil.Error):
                survivors.append(f"{proc.pid} {' '.join(proc.cmdline())[:100]}")
                proc.kill()
    if survivors:
        logger.warning("killed processes that outlived their node: %s", "; ".join(survivors))
    return survivors
