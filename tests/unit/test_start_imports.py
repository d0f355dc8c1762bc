"""A node's path to its first inner step imports no hivemind (issue 23): hivemind (with scipy)
costs seconds, and p2pd and the DHT start beside training (node.swarm_start)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import REPO


def test_the_join_command_and_the_node_import_no_hivemind() -> None:
    script = """
import sys
import node.cli, node.runtime, node.trainer
print(sorted(m for m in ("hivemind", "scipy", "dht.network", "dht.swarm") if m in sys.modules))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
