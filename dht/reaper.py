"""No orphans when a node is killed: a watchdog process reaps the node's children after it dies.

hivemind's DHT runs in a forked child and its p2pd daemon is yet another child; a SIGKILLed node
leaves both running, re-parented to init (HIVEMIND.md item 7). `OrphanReaper.start()` launches a
small watchdog (`python -m dht.reaper PARENT_PID`) in its own session, so Ctrl+C in the terminal
does not reach it. The node sends it the pids to watch, one line each. When the node dies, or
says so on a clean shutdown, the watchdog terminates every watched process still alive together
with its descendants, and removes the /tmp/hivemind-*.sock files those processes held.

The watchdog does not rely on EOF alone: a child forked after `start()` (the DHT) inherits the
write end of the pipe, so the pipe stays open while that child lives. The watchdog therefore also
notices its parent's death (it is re-parented), and a clean `close()` sends an explicit command.
"""

from __future__ import annotations

import contextlib
import ctypes
import fnmatch
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time

import psutil

logger = logging.getLogger(__name__)

POLL_S = 0.25
"""How often the watchdog checks for its parent's death and records new descendants."""
TERM_GRACE_S = 2.0
"""Time the reaped processes get between SIGTERM and SIGKILL."""
CLOSE_TIMEOUT_S = 5.0
"""How long `close()` waits for the watchdog before killing it."""
SOCKET_PATTERN = "/tmp/hivemind-*.sock"
REAP = "reap"
"""Command line: reap what is still alive, then exit (a clean shutdown)."""
RELEASE = "release"
"""Command line: exit without touching the watched processes."""
PR_SET_PDEATHSIG = 1
_SOCKET_IN_ARG = re.compile(r"/tmp/hivemind-[A-Za-z0-9_.-]+\.sock")


class ReaperError(ValueError):
    """The orphan reaper was used out of order or its watchdog could not be reached."""


class OrphanReaper:
    """The node's side of the watchdog: start it, tell it which pids to reap, close it."""

    def __init__(self) -> None:
        self._watchdog: subprocess.Popen[bytes] | None = None

    @property
    def watchdog_pid(self) -> int | None:
        return None if self._watchdog is None else self._watchdog.pid

    def start(self) -> None:
        """Launch the watchdog; it watches this process and reaps after it is gone."""
        if self._watchdog is not None:
            raise ReaperError("the orphan reaper is already started")
        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "dht.reaper", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        logger.debug("orphan reaper watchdog started as pid %d", self._watchdog.pid)

    def watch(self, pid: int) -> None:
        """Reap `pid` and its descendants if this process dies before they do."""
        self._send(str(pid))

    def close(self, kill: bool = True) -> None:
        """Stop the watchdog; with kill, it first reaps any watched process still alive."""
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is None:
            return
        with contextlib.suppress(BrokenPipeError, ValueError):
            _write_line(watchdog, REAP if kill else RELEASE)
        with contextlib.suppress(BrokenPipeError):
            if watchdog.stdin is not None:
                watchdog.stdin.close()
        try:
            watchdog.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("orphan reaper watchdog %d did not exit; killing it", watchdog.pid)
            watchdog.kill()
            watchdog.wait(timeout=CLOSE_TIMEOUT_S)

    def _send(self, line: str) -> None:
        if self._watchdog is None:
            raise ReaperError("the orphan reaper is not started; call start() first")
        try:
            _write_line(self._watchdog, line)
        except BrokenPipeError:
            raise ReaperError("the orphan reaper's watchdog has exited") from None


def set_parent_death_signal(
    sig: int = signal.SIGKILL, *, expected_parent: int | None = None
) -> bool:
    """Ask Linux to send `sig` to this process when its parent dies; False where unsupported.

    Call it in a child (e.g. as Popen's preexec_fn). The signal fires when the parent *thread*
    that spawned the child exits, so spawn from a thread that lives as long as the process.
    With expected_parent, a parent that died before this call is noticed and `sig` is raised.
    """
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(ctypes.get_errno()))
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def _write_line(watchdog: subprocess.Popen[bytes], line: str) -> None:
    if watchdog.stdin is None:
        raise BrokenPipeError
    watchdog.stdin.write(f"{line}\n".encode())
    watchdog.stdin.flush()


class _Watchdog:
    """The watchdog process: follows the watched process trees until the parent is gone."""

    def __init__(self, parent_pid: int) -> None:
        self._parent_pid = parent_pid
        self._parent = _process(parent_pid)
        self._tracked: dict[int, psutil.Process] = {}
        self._sockets: dict[str, list[psutil.Process]] = {}
        self._pending = b""

    def wait_for_command(self, fd: int) -> str:
        """Follow the watched processes until a command, EOF or the parent's death."""
        while True:
            readable, _, _ = select.select([fd], [], [], POLL_S)
            if readable and (command := self._read(fd)) is not None:
                return command
            if os.getppid() != self._parent_pid:
                logger.warning("parent %d is gone; reaping its children", self._parent_pid)
                return self._drain(fd) or REAP
            self._refresh()

    def reap(self) -> None:
        """SIGTERM every watched process still alive, SIGKILL it after a grace period."""
        self._refresh()
        alive = [p for p in self._tracked.values() if _alive(p)]
        if alive:
            logger.warning("reaping orphans %s", sorted(p.pid for p in alive))
        for proc in alive:
            _send_signal(proc, signal.SIGTERM)
        for proc in _wait_gone(alive, TERM_GRACE_S):
            _send_signal(proc, signal.SIGKILL)
        _wait_gone(alive, 1.0)
        self._remove_stale_sockets()

    def _read(self, fd: int) -> str | None:
        data = os.read(fd, 4096)
        if not data:
            return REAP
        self._pending += data
        *lines, self._pending = self._pending.split(b"\n")
        for line in lines:
            command = self._handle(line.decode(errors="replace").strip())
            if command is not None:
                return command
        return None

    def _drain(self, fd: int) -> str | None:
        """Read what the parent wrote before it died (it may not have been read yet)."""
        while select.select([fd], [], [], 0)[0]:
            command = self._read(fd)
            if command is not None:
                return command
        return None

    def _handle(self, line: str) -> str | None:
        if line in (REAP, RELEASE):
            return line
        if line.isdigit():
            self._track(int(line))
        elif line:
            logger.warning("ignoring unexpected line %r", line)
        return None

    def _track(self, pid: int) -> None:
        proc = _process(pid)
        if proc is None:
            logger.debug("watched pid %d has already exited", pid)
            return
        self._tracked.setdefault(proc.pid, proc)
        self._refresh()

    def _refresh(self) -> None:
        """Record the descendants and hivemind sockets of every tracked process still alive."""
        for proc in list(self._tracked.values()):
            with contextlib.suppress(psutil.Error):
                for child in proc.children(recursive=True):
                    self._tracked.setdefault(child.pid, child)
        owners = [*self._tracked.values(), *([self._parent] if self._parent else [])]
        for proc in owners:
            for path in _hivemind_sockets(proc):
                holders = self._sockets.setdefault(path, [])
                if proc not in holders:
                    holders.append(proc)

    def _remove_stale_sockets(self) -> None:
        for path, holders in self._sockets.items():
            if any(_alive(proc) for proc in holders):
                continue
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
                logger.info("removed stale socket %s", path)


def _process(pid: int) -> psutil.Process | None:
    """A handle that remembers the start time, so a reused pid is never mistaken for it."""
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _send_signal(proc: psutil.Process, sig: int) -> None:
    with contextlib.suppress(psutil.Error):
        if proc.is_running():
            proc.send_signal(sig)


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until the processes exit (zombies count as gone); returns those still alive."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    return alive


def _hivemind_sockets(proc: psutil.Process) -> set[str]:
    """Socket paths the process listens on or was told to listen on (p2pd's -listen)."""
    paths: set[str] = set()
    with contextlib.suppress(psutil.Error):
        for arg in proc.cmdline():
            paths.update(_SOCKET_IN_ARG.findall(arg))
        for conn in proc.net_connections(kind="unix"):
            if isinstance(conn.laddr, str):
                paths.add(conn.laddr)
    return {p for p in paths if fnmatch.fnmatch(p, SOCKET_PATTERN)}


def main(argv: list[str] | None = None) -> int:
    """The watchdog: `python -m dht.reaper PARENT_PID`, pids to watch on stdin."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        raise ReaperError("usage: python -m dht.reaper PARENT_PID (pids to watch on stdin)")
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s dht.reaper[{os.getpid()}]: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watchdog = _Watchdog(int(args[0]))
    if watchdog.wait_for_command(sys.stdin.fileno()) == REAP:
        watchdog.reap()
    return 0


if __name__ == "__main__":
    sys.exit(main())
