"""The import contracts of pyproject's [tool.importlinter] hold: layers dashboard > node > dht >
merge (node reaches dashboard only through node.dashboard_seam), dht reaches the merge only
through its port (dht.merge_port, never merge.pipeline), the settings import no model code, and
no module imports itself in a cycle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = [
    "Layers: dashboard above node above dht above merge",
    "The dashboard reads a node's status snapshot, events and settings, never the node",
    "dht reaches the merge through dht.merge_port, never merge.pipeline",
    "Settings import no model code: model names live with the models (node.presets)",
    "No import cycles inside a layer",
]


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
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in report, report
    flat = " ".join(report.split())  # lint-imports wraps long contract names
    for name in CONTRACTS:
        assert f"{name} KEPT" in flat, f"contract not checked: {name}\n{report}"
