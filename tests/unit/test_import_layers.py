"""The import contracts of pyproject's [tool.importlinter] hold: layers dashboard > node > dht >
merge (node reaches dashboard only through node.app), the settings import no model code, and no
module imports itself in a cycle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def lint_imports() -> list[str]:
    found = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    return (
        [found]
        if found
        else [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"]
    )


def test_import_contracts_are_kept() -> None:
    done = subprocess.run(
        [*lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    report = done.stdout + done.stderr
    assert done.returncode == 0, report
    assert "Contracts: 4 kept, 0 broken." in report, report
