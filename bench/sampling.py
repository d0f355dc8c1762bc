"""The benches' one background sampler: a thread that takes a sample every period.

A bench subclasses :class:`BackgroundSampler`, says what one sample is (``sample``) and reads
what it kept once the ``with`` block is over. Starting, the period, stopping and joining the
thread live here; so does reading a process's resident memory and open files, which a process
that has just exited makes fail (``rss_bytes`` and ``open_files`` say None then, and the
sample goes on with the others).
"""

from __future__ import annotations

import threading
from typing import Self

import psutil


class BackgroundSampler:
    """Calls ``sample()`` every ``period_s`` seconds on a daemon thread inside ``with``."""

    def __init__(self, period_s: float) -> None:
        if period_s <= 0:
            raise ValueError(f"a sampling period must be positive, not {period_s}")
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        """Takes one sample (a subclass says what); an exception ends the sampling."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases what sampling held, after the thread has stopped (nothing by default)."""

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()  # a sample in progress finishes before close() releases its tools
        self.close()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()


def rss_bytes(process: int | psutil.Process) -> int | None:
    """The resident memory of a process (a pid, or a psutil.Process kept to sample it often),
    or None when it is gone or not ours to read."""
    try:
        found = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return int(found.memory_info().rss)
    except psutil.Error:
        return None


def open_files(process: int | psutil.Process) -> int | None:
    """The file descriptors a process holds now, or None when it is gone or not ours."""
    try:
        found = process if isinstance(process, psutil.Process) else psutil.Process(process)
        return int(found.num_fds())
    except psutil.Error:
        return None
