"""Shared fixtures: isolated identity and checkpoint paths, JSON-event runs of the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def node_home(tmp_path: Path) -> Path:
    """A private ~/.diloco for one test: identity key and checkpoints never touch the real home."""
    home = tmp_path / "home"
    home.mkdir()
    return home


def run_cli(
    args: list[str], *, home: Path, timeout_s: float = 180
) -> tuple[int, list[dict[str, Any]], str]:
    """Run `diloco-node ARGS` in a child process; returns (exit code, JSON events, stderr)."""
    env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "node", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc.returncode, events, proc.stderr
