"""Updates a peer waits for a state to bring (not lost) are shown where lost ones are:
`diloco-node status` (per peer, and summed in its summary), the swarm route, the page's
summary and /metrics; a peer of the last release (no such count) shows 0."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dashboard.metrics import metrics_registry, render
from node.status import lost_cell, missing_label, print_status, status_document
from tests.dashboard.test_standalone import Swarm


@pytest.fixture
def swarm() -> Swarm:
    swarm = Swarm()
    swarm.beat("a", num_lost=3, num_need_state=85)
    swarm.beat("b")  # a peer of the last release: neither count said
    return swarm


def test_status_shows_each_peers_waiting_updates_beside_its_lost_ones(
    swarm: Swarm, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # a terminal wide enough that no cell wraps
    snapshots = swarm.observer.snapshot("run")

    (run,) = status_document("run", snapshots)["runs"]
    print_status("run", snapshots, as_json=False)

    rows = {row["peer_id"]: (row["lost"], row["need_state"]) for row in run["peers"]}
    assert rows == {swarm.peer_id("a"): (3, 85), swarm.peer_id("b"): (0, 0)}
    assert (run["summary"]["lost"], run["summary"]["need_state"]) == (3, 85)
    assert run["summary"]["peers_need_state"] == 1
    out = capsys.readouterr().out
    assert "3 updates lost, 85 waiting for a state (on 1 peer)" in out
    (line_a,) = [line for line in out.splitlines() if swarm.peer_id("a")[-12:] in line]
    assert " 3 +85 " in line_a


def test_the_swarm_route_and_metrics_show_them_for_live_peers(swarm: Swarm) -> None:
    shown = swarm.read()
    peers = {p["peer_id"]: (p["num_lost"], p["num_need_state"]) for p in shown["peers"]}
    assert peers == {swarm.peer_id("a"): (3, 85), swarm.peer_id("b"): (0, 0)}
    summary = shown["summary"]
    assert (summary["lost"], summary["need_state"], summary["peers_need_state"]) == (3, 85, 1)

    text = render(metrics_registry(swarm.source)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (total,) = families["diloco_updates_need_state"].samples
    assert total.value == 85
    per_peer = families["diloco_peer_updates_need_state"].samples
    by_peer = {s.labels["peer_id"]: s.value for s in per_peer}
    assert by_peer == {swarm.peer_id("a"): 85, swarm.peer_id("b"): 0}

    swarm.read(after_s=10.0)  # both silent past three heartbeats: dead, out of the sums
    swarm.beat("b")
    summary = swarm.read(after_s=0.0)["summary"]
    assert (summary["lost"], summary["need_state"], summary["peers_need_state"]) == (0, 0, 0)


def test_the_labels() -> None:
    assert missing_label(0, 0, 0) == "0 updates lost"
    assert missing_label(1, 2, 1) == "1 update lost, 2 waiting for a state (on 1 peer)"
    assert missing_label(0, 9, 3) == "0 updates lost, 9 waiting for a state (on 3 peers)"
    assert [lost_cell(3, 0), lost_cell(0, 85)] == ["3", "0 +85"]
