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
import resource
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
STDOUT_GRACE_S = 5.0
"""After the main process exits, how long its stdout may stay open (a forked DHT process
holds it until the node's reaper has taken it: at most ~3.3 s)."""
TAIL_LINES = 40
"""stderr lines quoted when a wait fails."""


class WaitError(TimeoutError, AssertionError):
    """An awaited event did not come: timed out, or the child exited first (with its stderr).

    A TimeoutError for benchmarks and an AssertionError for tests: one launcher serves both.
    """


class ChildProcess:
    """One child process, in its own process group, and the JSON events it has printed."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        *,
        home: Path,
        prefix: list[str] | None = None,
        max_open_files: int | None = None,
    ):
        self.name = name
        self.max_open_files = max_open_files
        """RLIMIT_NOFILE of the child (and everything it spawns); None: inherited."""
        self.argv = [*(prefix or []), *argv]
        self.home = home
        self.events: list[Event] = []
        """Every JSON event so far, each with the "time" it was printed (or read)."""
        self.stderr: deque[str] = deque(maxlen=STDERR_LINES)
        self.started_at = 0.0
        self.exited_at: float | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._proc: subprocess.Popen[str] | None = None

    def start(self) -> ChildProcess:
        if self._proc is not None:
            raise AssertionError(f"{self.name} is already started")
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
            preexec_fn=self._limit_open_files if self.max_open_files is not None else None,
        )
        self.started_at = time.time()
        assert self._proc.stdout is not None and self._proc.stderr is not None
        for stream, on_line in ((self._proc.stdout, self._on_stdout), (self._proc.stderr, None)):
            threading.Thread(target=self._read, args=(stream, on_line), daemon=True).start()
        logger.info("%s: started pid %d: %s", self.name, self._proc.pid, " ".join(self.argv))
        return self

    def _limit_open_files(self) -> None:
        """In the forked child, before exec: cap its file descriptors."""
        assert self.max_open_files is not None
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.max_open_files, self.max_open_files))

    @property
    def pid(self) -> int:
        """The main process; start_new_session makes it its group's id too."""
        if self._proc is None:
            raise AssertionError(f"{self.name} is not started")
        return self._proc.pid

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ---- faults ----------------------------------------------------------------------------

    def signal(self, sig: int) -> None:
        """Send `sig` to the main process only."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL the main process only, like a crash; its children are left to themselves."""
        self.signal(signal.SIGKILL)

    def crash(self) -> None:
        """kill -9 of the whole process group: the node and its DHT process and p2pd."""
        self._signal_group(signal.SIGKILL)
        self._wait(EXIT_TIMEOUT_S)

    def pause(self) -> None:
        """SIGSTOP the whole process group: the node, its DHT process and p2pd all freeze."""
        self._signal_group(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal_group(signal.SIGCONT)

    def renice(self, niceness: int) -> None:
        """Set the CPU niceness of every process in the group (root may lower it)."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.setpriority(os.PRIO_PGRP, self.pid, niceness)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """Ctrl+C (a clean stop that saves a checkpoint), then SIGKILL of the group if slow;
        the exit code."""
        self.interrupt()
        self.finish(timeout_s)
        return self._proc.poll() if self._proc is not None else None

    def interrupt(self) -> None:
        """Send Ctrl+C (SIGINT) to the main process, resuming the group first if frozen."""
        if self.alive():
            self.resume()
            self.signal(signal.SIGINT)

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

    def wait_exit(self, timeout_s: float) -> int:
        """The exit code (negative: killed by that signal), once stdout is read to its end."""
        if self._proc is None or not self._wait(timeout_s):
            raise WaitError(f"{self.name} did not exit within {timeout_s} s\n{self.stderr_tail()}")
        with self._cond:
            if not self._cond.wait_for(lambda: self._closed, STDOUT_GRACE_S):
                logger.warning("%s exited but its stdout is still held open", self.name)
        return self._proc.returncode

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

    def leftover_processes(self, timeout_s: float = EXIT_TIMEOUT_S) -> list[psutil.Process]:
        """leftovers() still alive after waiting up to `timeout_s` for them to go."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = self.leftovers()
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(0.1)

    # ---- events ----------------------------------------------------------------------------

    def of(self, name: str | None = None) -> list[Event]:
        """The events called `name` so far (all of them when None)."""
        with self._cond:
            return [e for e in self.events if name is None or e.get("event") == name]

    def wait_for(self, predicate: Callable[[Event], bool], timeout_s: float, what: str) -> Event:
        """The first event (already seen or still to come) that satisfies `predicate`."""
        deadline = time.monotonic() + timeout_s
        checked = 0
        with self._cond:
            while True:
                for event in self.events[checked:]:
                    if predicate(event):
                        return event
                checked = len(self.events)
                remaining = deadline - time.monotonic()
                if self._closed or remaining <= 0:
                    break
                self._cond.wait(min(remaining, 0.25))
        status = f"exited ({self._exit_status()})" if self._closed else "timed out"
        raise WaitError(f"{self.name}: {what}: {status} after {timeout_s} s\n{self.stderr_tail()}")

    def wait_event(self, name: str, timeout_s: float, **fields: Any) -> Event:
        """The first `name` event whose fields include `fields`."""
        return self.wait_for(
            lambda e: e.get("event") == name and all(e.get(k) == v for k, v in fields.items()),
            timeout_s,
            f"waiting for {name} {fields or ''}".rstrip(),
        )

    wait_for_event = wait_event

    def wait_listening(self, timeout_s: float) -> list[str]:
        """A node's full multiaddrs (with /p2p/<peer id>) that peers can join through."""
        return list(self.wait_event("listening", timeout_s)["maddrs"])

    @property
    def maddrs(self) -> list[str]:
        found = self.of("listening")
        if not found:
            raise AssertionError(f"{self.name} has not reported listening; use wait_listening")
        return list(found[0]["maddrs"])

    @property
    def peer_id(self) -> str:
        for event in self.of():
            if event.get("event") in ("listening", "started") and "peer_id" in event:
                return str(event["peer_id"])
        raise AssertionError(f"{self.name} has not reported its peer id yet")

    def stderr_tail(self, num_lines: int = TAIL_LINES) -> str:
        with self._cond:
            lines = list(self.stderr)[-num_lines:]
        return f"--- last {len(lines)} stderr lines of {self.name} ---\n" + "\n".join(lines)

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

    def _exit_status(self) -> str:
        # stdout closes a moment before the process can be reaped: wait that moment out.
        self._wait(EXIT_TIMEOUT_S)
        code = self._proc.poll() if self._proc is not None else None
        return "still running" if code is None else f"exit code {code}"

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


NODE_COMMAND = ["join", "--log-format", "json", "--host", "127.0.0.1", "--port", "0"]
"""How tests and benchmarks start a node: JSON events, loopback, any free port."""


def node_process(
    name: str,
    *args: str,
    home: Path,
    command: list[str] | None = None,
    max_open_files: int | None = None,
) -> ChildProcess:
    """A `python -m node` child (not started); later args override NODE_COMMAND's defaults."""
    argv = python_module("node", *(command or NODE_COMMAND), *args)
    return ChildProcess(name, argv, home=home, max_open_files=max_open_files)


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def cli_flags(**options: object) -> list[str]:
    """`--name value` pairs from keyword arguments; underscores in names become dashes."""
    flags = []
    for name, value in options.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def save_events(children: list[ChildProcess], folder: Path) -> None:
    """Every child's JSON events, one file per process (`--events-dir`: to look into a run):
    NAME.jsonl, and NAME-1.jsonl, NAME-2.jsonl, ... for later processes of the same name (a
    node restarted); beside each, NAME.stderr: the last STDERR_LINES lines of its logs."""
    folder.mkdir(parents=True, exist_ok=True)
    seen: dict[str, int] = {}
    for child in children:
        n = seen[child.name] = seen.get(child.name, -1) + 1
        stem = f"{child.name}-{n}" if n else child.name
        lines = "".join(json.dumps(e) + "\n" for e in child.events)
        (folder / f"{stem}.jsonl").write_text(lines)
        (folder / f"{stem}.stderr").write_text(child.stderr_tail(STDERR_LINES) + "\n")


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
