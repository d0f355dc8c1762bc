"""The highest update seq this identity has sealed in each run, on disk before it leaves.

An update id (author, seq) names one payload forever: peers treat a second, different payload
under an id they saw as equivocation. A node that crashed after publishing seq N but before
its next checkpoint would resume from the checkpoint's older seq and sign a different payload
as N again, unless it also learns N from its DHT announcement (which expires) or from a
donor's replica (which may not hold it yet). So the seq is recorded here, durably, before the
update is sealed: a restarted node continues after it. A crash between the record and the
publish leaves a seq that was never published; peers only fetch announced ids, so a gap in an
author's seqs costs nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

MAX_RUNS = 64
"""Runs remembered per identity (the oldest entries are dropped beyond this)."""


class SeqLedger:
    """Per run fingerprint, the highest seq sealed by one identity; a small JSON file."""

    def __init__(self, path: Path, fingerprint: str) -> None:
        self.path = path
        self.fingerprint = fingerprint
        self._cached: dict[str, int] | None = None

    def last(self) -> int:
        """The highest seq recorded for this run (0 when none, or the file is unreadable)."""
        return self._read().get(self.fingerprint, 0)

    def record(self, seq: int) -> None:
        """Durably records that `seq` is taken in this run; returns once it is on disk."""
        if type(seq) is not int or seq < 0:
            raise ValueError(f"seq must be an integer >= 0, got {seq!r}.")
        seqs = dict(self._read())
        if seqs.get(self.fingerprint, 0) >= seq:
            return
        seqs.pop(self.fingerprint, None)
        seqs[self.fingerprint] = seq  # most recent last: the oldest runs are dropped first
        while len(seqs) > max(MAX_RUNS, 1):
            del seqs[next(iter(seqs))]
        _write_durably(self.path, json.dumps(seqs).encode())
        self._cached = seqs

    def _read(self) -> dict[str, int]:
        if self._cached is None:
            self._cached = _parse(self.path)
        return self._cached


def _parse(path: Path) -> dict[str, int]:
    """The file's {fingerprint: seq} entries that are well formed; {} when absent or damaged
    (then the checkpoint, the DHT and the donor's replica are what a restart learns from)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {
        str(k): v for k, v in data.items() if type(v) is int and 0 <= v < 1 << 62 and len(k) < 128
    }


def _write_durably(path: Path, data: bytes) -> None:
    """Write to a temporary file, fsync it, rename it over `path`, fsync the directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    with contextlib.suppress(OSError):  # not every platform can open a directory
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
