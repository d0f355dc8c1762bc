"""A node's path to its first inner step imports neither hivemind nor the dashboard's page
(issue 23): hivemind (with scipy) costs seconds, the page's history models, fastapi and uvicorn
~0.5 s idle and ~3 s under load; p2pd, the DHT and the dashboard start beside training
(node.swarm_start, node.dashboard_seam)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

BESIDE_TRAINING = (
    "hivemind", "scipy", "dht.network", "dht.swarm",
    "dashboard.embedded", "dashboard.history", "dashboard.models", "fastapi", "uvicorn",
)  # fmt: skip


@pytest.fixture(scope="module")
def imported() -> list[str]:
    """One fresh interpreter importing what `join` imports (a few seconds under load), then
    making a JSON and a console event log: what it had imported at each point, one line each."""
    script = f"""
import sys
import node.cli, node.runtime, node.trainer
print(sorted(m for m in {BESIDE_TRAINING!r} if m in sys.modules))
from node.events import make_event_log
make_event_log("json")
before = "rich" in sys.modules
make_event_log("console").close()
print(before, "rich.console" in sys.modules)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()


def test_the_join_command_and_the_node_import_nothing_that_starts_beside_training(
    imported: list[str],
) -> None:
    assert imported[0] == "[]"


def test_rich_is_imported_by_the_console_log_only(imported: list[str]) -> None:
    """A node logging JSON (bench.chaos, services) never imports rich (~40 ms a start); the
    console's log does, when it is made."""
    assert imported[1].split() == ["False", "True"]
