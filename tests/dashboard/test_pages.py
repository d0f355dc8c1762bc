"""The whole swarm at 1000 peers, in memory: the dashboard's API and `status` show every peer's
totals and summary, and one bounded page of peers at a time (issue 22, item 5).

1000 signed heartbeats behind the fake DHT, read by the real StandaloneSource; the observer's
walk of the shard tree at 1000 peers is tests/unit/test_swarm_pages.py's."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from dashboard.app import create_app
from dashboard.history import History
from dashboard.settings import DashboardSettings
from dashboard.standalone import StandaloneSource
from dht.heartbeat import Heartbeat
from merge.identity import Identity
from node.status import print_status, status_document
from tests.dashboard.conftest import FakeObserver

N = 1000
ORGS = ("alpha", "beta", "gamma", "delta")


@pytest.fixture(scope="module")
def thousand() -> FakeObserver:
    """1000 peers in four organizations; peer i reports loss i / 100 and merged the updates
    of the peers i + 1 and i + 2 (so every author's updates are held by two peers)."""
    observer = FakeObserver()
    identities = [Identity.generate() for _ in range(N)]
    ids = [identity.peer_id for identity in identities]
    now = time.time()
    for i, identity in enumerate(identities):
        beat = Heartbeat(
            peer_id=identity.peer_id,
            org=ORGS[i % len(ORGS)],
            sent_at=now,
            heartbeat_period_s=60.0,
            round=i % 7,
            loss=i / 100,
            updates_published=1,
            merged_by_author={ids[(i + 1) % N]: 1, ids[(i + 2) % N]: 1},
            rejected_peers={ids[0]: {"bad_signature": 1}} if i % 10 == 0 else {},
        )
        observer.publish(beat, identity)
    return observer


def client(observer: FakeObserver) -> TestClient:
    settings = DashboardSettings(port=0)
    source = StandaloneSource(observer, "run", settings, History(settings))
    return TestClient(create_app(source, settings))


def test_the_swarm_route_pages_1000_peers_and_sums_all_of_them(thousand: FakeObserver) -> None:
    api = client(thousand)
    started = time.perf_counter()
    first = api.get("/api/swarm", params={"page": 1, "page_size": 50})
    took_s = time.perf_counter() - started
    assert first.status_code == 200
    body = first.json()
    assert body["page"] == {"number": 1, "size": 50, "pages": 20, "total": N}
    assert len(body["peers"]) == 50
    assert body["totals"]["peers_alive"] == N and body["summary"]["peers"] == N
    assert body["summary"]["states"] == {"syncing": 0, "training": N, "idle": 0}
    assert body["summary"]["learners"] == N  # each author merged by two peers
    assert body["summary"]["groups"] == 32  # 1000 peers, groups of >= 8: the 5-bit cap
    loss = body["summary"]["loss"]
    assert (loss["min"], loss["median"], loss["max"]) == (0.0, 5.0, 9.99)
    assert [o["peers_known"] for o in body["orgs"]] == [250] * 4
    (rejected,) = body["rejections"]
    assert rejected["total"] == N // 10 and rejected["reporters_total"] == N // 10
    assert len(rejected["reporters"]) == 16  # bounded, with the count beside it
    # What the browser holds per poll: one page, not 1000 heartbeats.
    whole = api.get("/api/swarm", params={"page_size": N}).content
    assert len(first.content) < len(whole) / 10, (len(first.content), len(whole))
    assert took_s < 10, took_s  # summing 1000 heartbeats per poll stays cheap

    seen: list[str] = []
    for number in range(1, 21):
        page = api.get("/api/swarm", params={"page": number, "page_size": 50}).json()
        seen.extend(p["peer_id"] for p in page["peers"])
    assert len(seen) == len(set(seen)) == N  # the pages partition the swarm
    assert seen == sorted(seen, key=lambda p: (thousand.heartbeats[p].org, p))

    last = api.get("/api/swarm", params={"page": 99, "page_size": 300}).json()
    assert last["page"]["number"] == 4 and len(last["peers"]) == N - 3 * 300
    assert api.get("/api/swarm", params={"page_size": 0}).status_code == 422
    assert api.get("/api/swarm", params={"page": 0}).status_code == 422


def test_status_shows_the_summary_and_one_page_of_1000_peers(
    thousand: FakeObserver, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    snapshots = thousand.snapshot("run")

    print_status("run", snapshots, as_json=True, page=(3, 40))
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    assert run["page"] == {"number": 3, "size": 40, "pages": 25}
    assert len(run["peers"]) == 40 and run["summary"]["peers"] == N
    assert run["summary"]["loss"]["median"] == 5.0
    ordered = [p.heartbeat.peer_id for p in snapshots[0].peers]
    assert [p["peer_id"] for p in run["peers"]] == ordered[80:120]

    print_status("run", snapshots, as_json=False, page=(25, 40))
    out = capsys.readouterr().out
    assert "peers 961-1000 of 1000 (page 25/25)" in out
    assert "1000 peers · 1000 training · 1000 learners · 32 learner groups" in out
    assert "next: --page" not in out
    assert status_document("run", snapshots)["runs"][0]["page"]["pages"] == 20
