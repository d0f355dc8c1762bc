"""`status` where the nodes are, and the join command others paste (issue 24, item 4).

That `status` without --peers shows a real running node's swarm is checked by
tests/swarm/test_swarm.py (its status call gives no --peers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dht.addresses import join_hint
from node.cli import main
from node.events import RecordingEventLog, _describe
from node.local_nodes import ControlFileEvents, LocalNode, find_local_nodes, write_control_file

PEER = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA"
LAN = f"/ip4/192.168.1.20/tcp/31337/p2p/{PEER}"
LOOPBACK = f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER}"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_status_without_peers_and_no_node_here_says_what_to_pass(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (
        f"diloco-node: error: no node runs on this machine (none announced in "
        f"{home / '.diloco' / 'nodes'}); pass --peers MADDR of any member of the swarm"
    )


def _dead_pid() -> int:
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], text=True,
                           capture_output=True, check=True)  # fmt: skip
    return int(child.stdout)


def test_control_files_of_live_nodes_are_found_and_of_dead_ones_removed(tmp_path: Path) -> None:
    live = LocalNode(PEER, "my-run", os.getpid(), [LAN, LOOPBACK])
    dead = LocalNode("12D3KooWGone", "my-run", _dead_pid(), [LAN])
    write_control_file(live, tmp_path)
    stale = write_control_file(dead, tmp_path)
    (tmp_path / "garbage.json").write_text("{not json")
    assert find_local_nodes(tmp_path) == [live]
    assert not stale.exists()
    assert live.dial_maddr() == LOOPBACK  # status dials from this machine


def test_a_node_keeps_its_control_file_from_listening_to_stopping(tmp_path: Path) -> None:
    events = ControlFileEvents(RecordingEventLog(), "my-run", tmp_path)
    events.emit("listening", peer_id=PEER, maddrs=[LOOPBACK], join_command="...")
    saved = json.loads((tmp_path / f"{PEER}.json").read_text())
    assert saved == {"peer_id": PEER, "run_id": "my-run", "pid": os.getpid(), "maddrs": [LOOPBACK]}
    events.emit("stopped", round=1, reason="max_rounds")
    assert list(tmp_path.iterdir()) == []


def test_the_printed_join_command_leads_with_an_address_other_machines_reach() -> None:
    command = join_hint([LOOPBACK, LAN], ["--model", "tiny"])
    line = _describe("listening", {"maddrs": [LOOPBACK, LAN], "join_command": command})
    assert line is not None
    assert f"others join with:\n  [bold]diloco-node join --peers {LAN} {LOOPBACK} " in line
