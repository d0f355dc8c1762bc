"""What the suite's controller writes before its workers start, on every core at once.

- The project's bytecode: with PYTHONDONTWRITEBYTECODE=1 in the environment (this machine's;
  Docker images often set it) an editable install's modules never get a .pyc, so every process
  the suite starts (~100 nodes, CLI runs, adversaries) compiled ~300 modules again: ~1 s of CPU
  each (docs/testing.md, session 28). The variable only stops imports from writing; they still
  read what is there.
- pytest's assertion-rewritten test modules (`__pycache__/*-pytest-X.pyc`): pytest writes them
  only where bytecode may be written, so with that variable set each xdist worker rewrote all
  ~260 test modules while collecting (12.4 of a worker's 17.7 s of collection, idle machine,
  session 29). Written once here, both workers read them. Without the variable the first run's
  two workers still rewrote each module twice, at once.

Each file is written only when missing or stale (pytest's and Python's own freshness rules:
the source's mtime and size), so a run after the first one checks and writes nothing.
"""

from __future__ import annotations

import compileall
import multiprocessing
import os
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from _pytest.assertion import rewrite

COMPILE = "compile"
REWRITE = "rewrite"


class _Untraced:
    """pytest's assertion state, as its pyc writer uses it: a trace for failures only."""

    def trace(self, message: str) -> None:
        """A pyc that cannot be written is pytest's to rewrite again, as before."""


def is_test_module(path: Path) -> bool:
    """pytest rewrites the asserts of these (its default `python_files`, and conftests)."""
    name = path.name
    return name == "conftest.py" or (name.startswith("test_") and name.endswith(".py"))


def rewritten_pyc(path: Path) -> Path:
    """Where pytest looks for `path`'s rewritten bytecode."""
    return rewrite.get_cache_dir(path) / (path.name[:-3] + rewrite.PYC_TAIL)


def rewrite_test_module(path: Path) -> bool:
    """Write `path`'s rewritten bytecode unless a current one is there; False if it does not
    compile (pytest then reports it as it would have)."""
    pyc = rewritten_pyc(path)
    if rewrite._read_pyc(path, pyc) is not None:
        return True
    try:
        source_stat, code = rewrite._rewrite_test(path, None)  # type: ignore[arg-type]
    except SyntaxError:
        return False
    pyc.parent.mkdir(exist_ok=True)
    return rewrite._write_pyc(_Untraced(), code, source_stat, pyc)  # type: ignore[arg-type]


def prepare_one(task: tuple[str, Path]) -> bool:
    kind, path = task
    if kind == REWRITE:
        return rewrite_test_module(path)
    return bool(compileall.compile_file(path, quiet=2))


def tasks(root: Path, compiled: Iterable[str], tests: str) -> list[tuple[str, Path]]:
    """Every source of `compiled` to compile, and every test module under `tests` to rewrite."""
    sources = sorted(p for name in compiled for p in (root / name).rglob("*.py"))
    modules = [p for p in sorted((root / tests).rglob("*.py")) if is_test_module(p)]
    return [(REWRITE, p) for p in modules] + [(COMPILE, p) for p in sources]


def prepare(root: Path, compiled: Iterable[str], tests: str, *, rewrite_asserts: bool) -> bool:
    """Compile and rewrite on every core this process may use; False if a file failed (its
    import then fails as it would have)."""
    todo = [t for t in tasks(root, compiled, tests) if rewrite_asserts or t[0] == COMPILE]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not cores or cores < 2:
        return all(map(prepare_one, todo))
    context = multiprocessing.get_context("fork")  # before any worker or thread starts
    with ProcessPoolExecutor(max_workers=cores, mp_context=context) as pool:
        return all(pool.map(prepare_one, todo, chunksize=8))
