"""The nodes running on this machine, for `diloco-node status` without --peers.

A node that listens writes a control file, ~/.diloco/nodes/PEER_ID.json, with its pid, run and
addresses, and removes it when it stops. A node killed outright leaves its file behind: a
file whose process is gone is skipped (and removed) by whoever reads it.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dht.addresses import is_loopback
from node.config import DILOCO_HOME
from node.events import EventLog

logger = logging.getLogger(__name__)

NODES_DIR = DILOCO_HOME / "nodes"
MAX_CONTROL_FILE_BYTES = 64 * 1024


@dataclass(frozen=True)
class LocalNode:
    peer_id: str
    run_id: str
    pid: int
    maddrs: list[str]

    def dial_maddr(self) -> str:
        """The address to reach it from this machine: a loopback one when it listens there."""
        loopback = [m for m in self.maddrs if is_loopback(m)]
        return (loopback or self.maddrs)[0]


def nodes_dir() -> Path:
    return NODES_DIR.expanduser()


def write_control_file(node: LocalNode, directory: Path) -> Path:
    """Atomically (a reader never sees half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{node.peer_id}.json"
    fd, tmp = tempfile.mkstemp(prefix=".node-", suffix=".tmp", dir=directory)
    with os.fdopen(fd, "w") as handle:
        json.dump(asdict(node), handle)
    os.replace(tmp, path)
    return path


def find_local_nodes(directory: Path) -> list[LocalNode]:
    """The live nodes whose control files are in `directory`, by peer id; files of processes
    that are gone are removed, unreadable ones skipped."""
    nodes = []
    for path in sorted(directory.glob("*.json")):
        node = _read(path)
        if node is None:
            continue
        if not process_alive(node.pid):
            path.unlink(missing_ok=True)
            continue
        nodes.append(node)
    return nodes


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, alive
    return True


def _read(path: Path) -> LocalNode | None:
    try:
        if path.stat().st_size > MAX_CONTROL_FILE_BYTES:
            raise ValueError("too large")
        fields: Any = json.loads(path.read_text())
        node = LocalNode(
            peer_id=str(fields["peer_id"]),
            run_id=str(fields["run_id"]),
            pid=int(fields["pid"]),
            maddrs=[str(m) for m in fields["maddrs"]],
        )
        if node.pid <= 0 or not node.maddrs:
            raise ValueError("no process or no address")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.info("skipping the control file %s (%s)", path, exc)
        return None
    return node


class ControlFileEvents:
    """A node's event log, unchanged, that also keeps its control file: written when the node
    listens, removed when it stops (or its event log closes)."""

    def __init__(self, events: EventLog, run_id: str, directory: Path | None = None) -> None:
        self._events, self._run_id = events, run_id
        self._directory = directory or nodes_dir()
        self._path: Path | None = None

    def emit(self, event: str, **fields: Any) -> None:
        if event == "listening":
            self._announce(fields)
        elif event == "stopped":
            self._withdraw()
        self._events.emit(event, **fields)

    def progress(self, **fields: Any) -> None:
        self._events.progress(**fields)

    def close(self) -> None:
        self._withdraw()
        self._events.close()

    def _announce(self, fields: dict[str, Any]) -> None:
        node = LocalNode(str(fields["peer_id"]), self._run_id, os.getpid(), list(fields["maddrs"]))
        try:
            self._path = write_control_file(node, self._directory)
        except OSError as exc:  # status without --peers will not find it; the node runs on
            logger.warning("could not write the control file in %s (%s)", self._directory, exc)

    def _withdraw(self) -> None:
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None
