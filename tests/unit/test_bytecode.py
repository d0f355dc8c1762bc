"""bench.bytecode: the benchmarks' nodes load the repository's modules compiled, as an
installed node does, whatever PYTHONDONTWRITEBYTECODE says."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from bench.bytecode import PACKAGES, compile_packages


def _tree(root: Path, source: str) -> Path:
    for name in PACKAGES:
        (root / name).mkdir()
        (root / name / "__init__.py").write_text("")
    module = root / "node" / "startup_probe.py"
    module.write_text(source)
    return module


def _loaded_from(root: Path) -> str:
    """`python -v`'s account of where node.startup_probe's code came from."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-v", "-c", "import node.startup_probe"],
        env=env,
        cwd=root,  # not the repository: its node/ would come first
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stderr.splitlines()
    return next(line for line in lines if "code object from" in line and "startup_probe" in line)


def test_the_nodes_modules_load_from_bytecode_with_writing_turned_off(tmp_path: Path) -> None:
    module = _tree(tmp_path, "VALUE = 1\n")
    cached = importlib.util.cache_from_source(str(module))
    assert _loaded_from(tmp_path) == f"# code object from {module}"  # compiled from source
    assert not Path(cached).exists()  # and not written
    assert compile_packages(tmp_path)
    assert _loaded_from(tmp_path) == f"# code object from '{cached}'"


def test_a_module_that_does_not_compile_is_reported(tmp_path: Path) -> None:
    _tree(tmp_path, "def broken(:\n")
    assert not compile_packages(tmp_path)
