"""The embedded server's lifecycle, the CLI's errors and the heartbeat fields goodput needs."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from dashboard.settings import StandaloneConfig
from dht.heartbeat import MAX_AUTHORS, Heartbeat, HeartbeatError, sign_fields
from merge.identity import Identity
from node.cli import main
from node.events import RecordingEventLog
from node.runtime import Node
from tests.dashboard.conftest import SMALL_CORPUS, node_config

START_S = 60.0
PEER = "/ip4/127.0.0.1/tcp/31337/p2p/12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq"


def wait_for_event(events: RecordingEventLog, name: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while not (found := events.of(name)):
        assert time.monotonic() < deadline, f"no {name} event within {timeout_s} s"
        time.sleep(0.05)
    return found[0]


def test_embedded_dashboard_serves_while_the_node_trains_and_stops_with_it(
    tmp_path: Path,
) -> None:
    events = RecordingEventLog()
    node = Node(node_config(tmp_path), events)
    runner = threading.Thread(target=node.run, name="node")
    runner.start()
    try:
        url = wait_for_event(events, "dashboard", START_S)["url"]
        assert url.startswith("http://127.0.0.1:")
        wait_for_event(events, "round_done", START_S)
        answer = httpx.get(url + "api/node", timeout=10).json()
        assert answer["peer_id"] == node.peer_id and answer["state"] == "training"
    finally:
        node.request_stop()
        runner.join(timeout=30)
    assert not runner.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("dashboard")]
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "healthz", timeout=5)


def test_a_dashboard_port_in_use_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(
            ["join", "--no-swarm", "--model", "tiny", "--data", SMALL_CORPUS,
             "--log-format", "json", "--identity", str(tmp_path / "id.key"),
             "--checkpoint-dir", str(tmp_path / "ckpt"), "--dashboard-port", str(port)]
        )  # fmt: skip
    assert code == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert line == (
        f"diloco-node: error: the dashboard cannot listen on 127.0.0.1:{port}: "
        "Address already in use; pass another --dashboard-port (0: any free port)"
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["dashboard"], "--peers is required"),
        (["dashboard", "--peers", "nonsense"], "--peers: 'nonsense' is not a valid multiaddr"),
        (["dashboard", "--peers", PEER, "--port", "-1"], "--port must be between 0 and 65535"),
        (["dashboard", "--peers", PEER, "--host", "localhost"], "--host must be an IP address"),
        (["dashboard", "--peers", PEER, "--token", "a b"], "--token must be printable ASCII"),
        (["dashboard", "--peers", PEER, "--port", "eighty"], "invalid int value"),
        (["join", "--dashboard-port", "70000"], "--dashboard-port must be between 0 and 65535"),
        (["join", "--dashboard-host", "example.org"], "--dashboard-host must be an IP address"),
        (["join", "--dashboard-token", "tab\there"], "--dashboard-token must be printable"),
        (["join", "--dashboard-token-file", "/nonexistent/token"], "could not be read"),
        (["dashboard", "--peers", PEER, "--token-file", "/nonexistent"], "could not be read"),
    ],
)
def test_bad_dashboard_flags_give_one_clear_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if "invalid int" in expected:  # argparse's own errors exit with 2
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
    else:
        assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert expected in line


def test_a_token_file_keeps_the_token_off_the_command_line(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    token_file.chmod(0o600)
    config = node_config(tmp_path, dashboard_token_file=str(token_file))
    assert config.dashboard_token == "from-a-file"
    standalone = StandaloneConfig(peers=[PEER], token_file=str(token_file))
    assert standalone.settings().token == "from-a-file"


def test_a_token_file_others_may_read_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    token_file.chmod(0o644)
    assert main(["dashboard", "--peers", PEER, "--token-file", str(token_file)]) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "readable by other users" in line and "from-a-file" not in line


def test_node_heartbeat_carries_merged_counts_and_staleness(trained_node: Node) -> None:
    identity = trained_node.identity
    heartbeat = Heartbeat.verify(trained_node.heartbeat().sign(identity), identity.peer_id)

    assert heartbeat.merged_by_author == {trained_node.peer_id: 2}
    assert heartbeat.staleness_histogram[0] == 2 and sum(heartbeat.staleness_histogram) == 2
    assert heartbeat.heartbeat_period_s == trained_node.config.heartbeat_period


@pytest.mark.parametrize(
    "fields",
    [
        {"merged_by_author": {"peer": -1}},
        {"merged_by_author": {"peer": 1.5}},
        {"merged_by_author": {f"peer{i}": 1 for i in range(MAX_AUTHORS + 1)}},
        {"staleness_histogram": [1] * 8},
        {"staleness_histogram": [True]},
        {"rejections": {"replay": "many"}},
        {"loss": float("nan")},
        {"val_loss": "low"},
        {"org": ["<script>"]},
        {"heartbeat_period_s": float("inf")},
    ],
)
def test_malformed_dashboard_fields_are_rejected(fields: dict[str, Any]) -> None:
    identity = Identity.generate()
    body = dataclasses.asdict(Heartbeat(peer_id=identity.peer_id)) | fields

    with pytest.raises(HeartbeatError):
        Heartbeat.verify(sign_fields(body, identity), identity.peer_id)
