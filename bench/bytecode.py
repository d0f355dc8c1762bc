"""The repository's modules compiled to bytecode before a benchmark starts its nodes, as a
node installed by pip has them (pip compiles at install).

With PYTHONDONTWRITEBYTECODE=1 (the sessions' environment sets it) nothing writes
`__pycache__`, so a node started from the repository compiled every module of node/, merge/,
dht/ and dashboard/ from source at each start: 0.45 s of CPU more than with the bytecode
(`import node.cli` after torch, 3 runs each, load ~6: 0.99 s against 0.55 s), ~1 s of a
restart's wall time at bench.chaos's load. Start-up figures then measured the
environment, not the node. The files go to each package's `__pycache__` (git ignores it);
PYTHONDONTWRITEBYTECODE only stops Python writing them, not reading them.
"""

from __future__ import annotations

import compileall
from pathlib import Path

from bench.procs import REPO

PACKAGES = ("node", "merge", "dht", "dashboard", "bench")


def compile_packages(root: Path = REPO) -> bool:
    """Compile the packages under `root` where their bytecode is missing or stale; True if
    every module compiled."""
    return all(compileall.compile_dir(root / name, quiet=2) for name in PACKAGES)
