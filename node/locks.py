"""Exclusive locks on what one node must not share with another on the same machine.

An advisory `flock` on a `.lock` file next to the resource: the kernel drops it when the
holding process exits, however it exits, so a crashed node never blocks its restart.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


class InUseError(ValueError):
    """Another live process holds the lock; the message names the flag to change."""


class ResourceLock:
    """Held from acquire() until release() (or until this process exits)."""

    def __init__(self, lock_path: Path, what: str, flag: str) -> None:
        self.path = lock_path
        self._what = what
        self._flag = flag
        self._file: IO[str] | None = None

    def acquire(self) -> ResourceLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")  # noqa: SIM115  (held open while the node runs)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            handle.close()
            raise InUseError(
                f"{self._what} is in use by another node on this machine (pid {holder}); "
                f"give this node its own with {self._flag}"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._file = handle
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock
            self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None


MAX_IDENTITY_SLOTS = 64
"""Default identities one machine's nodes may take: identity.key, identity-2.key, ..."""


def lock_identity(identity_path: Path, *, is_default: bool) -> tuple[Path, ResourceLock]:
    """The identity this node runs with, locked.

    An explicit --identity that another node holds is an error naming the flag. The default
    one held by another node on this machine (several nodes started with default paths) moves
    this node to the first free `identity-N.key` beside it, created on first use: the same
    slot, so the same peer id and checkpoints, whenever it is free again.
    """
    try:
        return identity_path, identity_lock(identity_path).acquire()
    except InUseError as exc:
        if not is_default:
            raise
        in_use = exc
    for slot in range(2, MAX_IDENTITY_SLOTS + 1):
        path = identity_path.with_name(f"{identity_path.stem}-{slot}{identity_path.suffix}")
        try:
            return path, identity_lock(path).acquire()
        except InUseError:
            continue
    raise in_use


def identity_lock(identity_path: Path) -> ResourceLock:
    return ResourceLock(
        identity_path.with_name(identity_path.name + ".lock"),
        f"identity {identity_path}",
        "--identity PATH (a new key is created there)",
    )


def checkpoint_lock(directory: Path) -> ResourceLock:
    return ResourceLock(directory / ".lock", f"checkpoint dir {directory}", "--checkpoint-dir")
