"""The suite compiles the project before its tests (tests/conftest.py, compile_sources): every
module of COMPILED has a current .pyc, so the processes the tests start (nodes, CLI runs) read
bytecode even where PYTHONDONTWRITEBYTECODE=1 keeps imports from writing it."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

from tests.conftest import COMPILED, REPO


def stale(source: Path) -> bool:
    """True if `source` has no .pyc, or one written from another version of it."""
    cached = Path(importlib.util.cache_from_source(str(source)))
    if not cached.exists():
        return True
    header = cached.read_bytes()[:16]
    flags, mtime, size = struct.unpack("<III", header[4:16])
    stat = source.stat()
    return (
        flags != 0 or mtime != int(stat.st_mtime) & 0xFFFFFFFF or size != stat.st_size & 0xFFFFFFFF
    )


def test_every_module_the_tests_start_has_its_bytecode() -> None:
    sources = [p for name in COMPILED for p in (REPO / name).rglob("*.py")]
    assert len(sources) > 300
    assert [str(p.relative_to(REPO)) for p in sources if stale(p)] == []
