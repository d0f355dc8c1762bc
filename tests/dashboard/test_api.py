"""The JSON API, /metrics, /healthz and the token, against real data sources."""

from __future__ import annotations

import dataclasses
import re

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from dashboard import app as app_module
from dashboard.app import STATIC_DIR, create_app
from dashboard.embedded import EmbeddedSource
from dashboard.history import History
from dashboard.settings import DashboardSettings
from dashboard.standalone import StandaloneSource
from dht.transfer_progress import ProgressReport
from node.runtime import Node
from node.snapshot import NodeStatus
from tests.dashboard.conftest import FakeObserver
from tests.factories import sealed_update

PEER_FIELDS = {
    "peer_id", "org", "state", "alive", "round", "updates_published", "updates_merged",
    "tokens_per_s", "loss", "staleness_mean", "last_seen_s",
}  # fmt: skip
TOTALS_FIELDS = {"peers_alive", "tokens_per_s", "updates_merged", "goodput", "drift"}
TOKEN = "s3cret-token"


def embedded_client(node: Node, token: str | None = None) -> TestClient:
    assert node.dashboard is not None
    settings = DashboardSettings(host="127.0.0.1", port=0, token=token)
    return TestClient(create_app(node.dashboard.source, settings))


def standalone_client(observer: FakeObserver, token: str | None = None) -> TestClient:
    settings = DashboardSettings(port=0, token=token)
    source = StandaloneSource(observer, "run", settings, History(settings))
    return TestClient(create_app(source, settings))


def test_swarm_lists_the_node_with_the_documented_fields(trained_node: Node) -> None:
    swarm = embedded_client(trained_node).get("/api/swarm").json()

    assert swarm["mode"] == "embedded"
    assert swarm["run_id"] == trained_node.config.run_id
    assert swarm["fingerprint"] == trained_node.fingerprint
    (peer,) = swarm["peers"]
    assert peer.keys() >= PEER_FIELDS
    assert swarm["totals"].keys() >= TOTALS_FIELDS
    assert peer["peer_id"] == trained_node.peer_id and peer["local"] and peer["alive"]
    assert peer["org"] == "lab" and peer["round"] == 2 and peer["updates_merged"] == 2
    assert peer["tokens_per_s"] > 0 and peer["loss"] > 0 and peer["last_seen_s"] == 0
    assert swarm["totals"]["peers_alive"] == 1
    assert sum(b["count"] for b in swarm["staleness_histogram"]) == 2
    assert [o["org"] for o in swarm["orgs"]] == ["lab"]


def test_node_route_counts_rejected_updates(trained_node: Node) -> None:
    replay = sealed_update(
        trained_node.identity, fingerprint=trained_node.fingerprint, seq=1, inner_steps=2,
        tokens=2, loss=1.0, numel=trained_node.num_params, created_at=None,
    )  # fmt: skip
    trained_node.report_merge(trained_node.pipeline.submit(replay))
    trained_node.dashboard.source.refresh()  # type: ignore[union-attr]

    node = embedded_client(trained_node).get("/api/node").json()

    assert node["peer_id"] == trained_node.peer_id
    assert node["rejections"] == {"equivocation": 1} and node["rejected_total"] == 1
    assert node["rejected_peers"] == {trained_node.peer_id: {"equivocation": 1}}
    assert node["num_applied"] == 2 and node["round"] == 2
    timeline = embedded_client(trained_node).get("/api/history").json()["timeline"]
    assert timeline[-1]["kind"] == "rejected" and "equivocation" in timeline[-1]["detail"]


def test_node_route_shows_a_state_download_while_it_runs(trained_node: Node) -> None:
    progress = ProgressReport(
        peer_id="12D3KooWdonor", num_bytes=5_000_000, total_bytes=20_000_000,
        bytes_per_s=1e6, eta_s=15.0, elapsed_s=5.0,
    )  # fmt: skip
    settings = DashboardSettings(host="127.0.0.1", port=0)

    def downloading() -> NodeStatus:
        return dataclasses.replace(trained_node.status(), state_download=progress)

    source = EmbeddedSource(trained_node.config.run_id, downloading, settings, History(settings))
    node = TestClient(create_app(source, settings)).get("/api/node").json()

    assert node["state_download"] == dataclasses.asdict(progress)
    assert embedded_client(trained_node).get("/api/node").json()["state_download"] is None


def test_node_route_shows_the_codec_and_the_measured_uplink(trained_node: Node) -> None:
    node = embedded_client(trained_node).get("/api/node").json()
    assert (node["codec"], node["codec_auto"]) == ("bf16", True)  # the default: auto, bf16 first
    (peer,) = embedded_client(trained_node).get("/api/swarm").json()["peers"]
    assert (peer["codec"], peer["codec_auto"]) == ("bf16", True)  # its own heartbeat's

    def picked() -> NodeStatus:
        status = trained_node.status()
        return dataclasses.replace(status, codec="topk", codec_auto=True, uplink_bytes_per_s=6e5)

    settings = DashboardSettings(host="127.0.0.1", port=0)
    source = EmbeddedSource(trained_node.config.run_id, picked, settings, History(settings))
    node = TestClient(create_app(source, settings)).get("/api/node").json()
    assert (node["codec"], node["codec_auto"], node["uplink_bytes_per_s"]) == ("topk", True, 6e5)


def test_the_fresh_keys_the_node_sets_aside_are_shown_beside_peers_alive(
    trained_node: Node,
) -> None:
    """dht.membership sets fresh keys beyond its bound aside (no pushes, not counted): the
    node's count reaches /api/node, the totals, the history and /metrics."""
    settings = DashboardSettings(host="127.0.0.1", port=0)
    history = History(settings)

    def flooded() -> NodeStatus:
        return dataclasses.replace(trained_node.status(), fresh_peers_set_aside=7)

    source = EmbeddedSource(trained_node.config.run_id, flooded, settings, history)
    source.refresh()  # one poll: one history point
    client = TestClient(create_app(source, settings))

    assert client.get("/api/node").json()["fresh_peers_set_aside"] == 7
    assert client.get("/api/swarm").json()["totals"]["fresh_peers_set_aside"] == 7
    assert client.get("/api/history").json()["swarm"][-1]["fresh_peers_set_aside"] == 7
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert families["diloco_fresh_peers_set_aside"].samples[0].value == 7
    # a node without a swarm sets none aside; each round_done says so beside peers_alive
    assert trained_node.status().fresh_peers_set_aside == 0
    rounds = trained_node.events._inner.of("round_done")  # type: ignore[attr-defined]
    assert [(e["peers_alive"], e["fresh_peers_set_aside"]) for e in rounds] == [(0, 0)] * 2
    assert embedded_client(trained_node).get("/api/node").json()["fresh_peers_set_aside"] == 0


def test_a_standalone_dashboard_has_no_count_of_fresh_keys_set_aside() -> None:
    """It serves no node: nothing is set aside by it, and it says so (null, no gauge)."""
    import time

    from dht.heartbeat import Heartbeat
    from merge.identity import Identity

    alice = Identity.generate()
    observer = FakeObserver()
    observer.publish(Heartbeat(peer_id=alice.peer_id, sent_at=time.time()), alice)
    client = standalone_client(observer)

    assert client.get("/api/swarm").json()["totals"]["fresh_peers_set_aside"] is None
    families = {f.name for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert "diloco_peers_alive" in families and "diloco_fresh_peers_set_aside" not in families


def test_history_has_a_loss_point_per_round_and_the_events_pass_through(
    trained_node: Node,
) -> None:
    trained_node.events.emit("peer_joined", peer_id="12D3KooWpeer", org="other")
    trained_node.dashboard.source.refresh()  # type: ignore[union-attr]  # one poll

    history = embedded_client(trained_node).get("/api/history").json()

    (series,) = history["peers"]
    assert [p["round"] for p in series["points"]] == [1, 2]
    assert all(p["val_loss"] is not None for p in series["points"])
    assert history["swarm"] and history["swarm"][-1]["peers_alive"] == 1
    assert history["timeline"][-1] == {
        "t": history["timeline"][-1]["t"],
        "kind": "joined",
        "peer_id": "12D3KooWpeer",
        "detail": "org other",
    }
    recorded = trained_node.events._inner.of("peer_joined")  # type: ignore[attr-defined]
    assert recorded == [{"event": "peer_joined", "peer_id": "12D3KooWpeer", "org": "other"}]


def test_metrics_parse_as_prometheus_text(trained_node: Node) -> None:
    trained_node.pipeline.rejections["bad_signature"] += 3
    for _ in range(3):
        trained_node.pipeline.rejection_log.count("12D3KooWforger", "bad_signature")
    response = embedded_client(trained_node).get("/metrics")

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    assert families["diloco_peers_alive"].samples[0].value == 1
    (alive,) = families["diloco_peer_alive"].samples
    assert alive.labels == {"peer_id": trained_node.peer_id, "org": "lab"}
    assert families["diloco_peer_round"].samples[0].value == 2
    by_staleness = families["diloco_merges_by_staleness"].samples
    assert {s.labels["staleness"]: s.value for s in by_staleness}["0"] == 2
    rejected = {s.labels["reason"]: s.value for s in families["diloco_node_rejections"].samples}
    assert rejected["bad_signature"] == 3
    (by_peer,) = families["diloco_node_rejections_by_peer"].samples
    assert by_peer.labels == {"peer_id": "12D3KooWforger", "reason": "bad_signature"}
    assert by_peer.value == 3


def test_token_guards_every_route(trained_node: Node) -> None:
    client = embedded_client(trained_node, token=TOKEN)
    routes = ["/", "/static/dashboard.js", "/api/swarm", "/api/node", "/api/history",
              "/metrics", "/healthz", "/docs", "/openapi.json",
              "/docs-assets/swagger-ui-bundle.js", "/docs-assets/swagger-ui.css"]  # fmt: skip

    for route in routes:
        refused = client.get(route)
        assert refused.status_code == 401, route
        assert refused.headers["www-authenticate"] == "Bearer"
        wrong = client.get(route, headers={"Authorization": "Bearer not-the-token"})
        assert wrong.status_code == 401, route
        assert client.get(route, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_browser_token_is_exchanged_once_for_a_cookie(trained_node: Node) -> None:
    client = embedded_client(trained_node, token=TOKEN)

    assert client.get("/?token=wrong", follow_redirects=False).status_code == 401
    assert client.get(f"/api/swarm?token={TOKEN}").status_code == 401  # only / takes ?token=
    landing = client.get(f"/?token={TOKEN}", follow_redirects=False)
    assert landing.status_code == 303 and landing.headers["location"] == "/"
    cookie = landing.headers["set-cookie"]
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    assert TOKEN not in cookie
    assert client.get("/api/swarm").status_code == 200  # the cookie alone now suffices
    assert client.get("/").status_code == 200


def test_every_route_is_read_only(trained_node: Node) -> None:
    client = embedded_client(trained_node)
    paths = client.get("/openapi.json").json()["paths"]

    assert {"/api/swarm", "/api/node", "/api/history", "/metrics", "/healthz"} <= paths.keys()
    assert all(operations.keys() == {"get"} for operations in paths.values())
    for method in ("POST", "PUT", "PATCH", "DELETE"):
        assert client.request(method, "/api/swarm").status_code == 405


def test_page_needs_nothing_from_the_internet(trained_node: Node) -> None:
    client = embedded_client(trained_node)
    page = client.get("/")

    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text)
    assert len(assets) == 2
    for asset in assets:
        assert client.get(asset).status_code == 200, asset
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"(?:src|href)=\"https?:|url\(\s*['\"]?https?:|@import", text), path
        assert not re.search(r"fetch\(\s*[\"'`]https?:", text), path


def test_healthz_is_ok_while_the_swarm_is_read(trained_node: Node) -> None:
    health = embedded_client(trained_node).get("/healthz")

    assert health.status_code == 200
    assert health.json()["status"] == "ok" and health.json()["peers_alive"] == 1


def test_standalone_has_no_node_and_reports_a_dht_that_never_answers() -> None:
    client = standalone_client(FakeObserver(failing=True))

    assert client.get("/api/node").status_code == 404
    health = client.get("/healthz")
    assert health.status_code == 503 and health.json()["status"] == "stale"
    swarm = client.get("/api/swarm").json()
    assert swarm["mode"] == "standalone" and swarm["peers"] == []
    assert swarm["totals"]["goodput"] is None


def test_openapi_documents_typed_responses(trained_node: Node) -> None:
    schema = embedded_client(trained_node).get("/openapi.json").json()
    ok = {p: schema["paths"][p]["get"]["responses"]["200"] for p in schema["paths"]}

    for path in ("/api/swarm", "/api/node", "/api/history", "/healthz"):
        assert "$ref" in ok[path]["content"]["application/json"]["schema"], path
    peer = schema["components"]["schemas"]["PeerOut"]
    assert peer["properties"].keys() >= PEER_FIELDS


@pytest.mark.parametrize("bad", ["", "has space", "tab\there", "ünïcode"])
def test_unusable_tokens_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="token"):
        DashboardSettings(token=bad)


def test_docs_work_offline_from_local_files(trained_node: Node) -> None:
    client = embedded_client(trained_node)
    page = client.get("/docs")
    assert page.status_code == 200
    assert "://" not in page.text  # no CDN: every asset is served by the dashboard itself
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
    for asset in assets:
        assert client.get(asset).status_code == 200, asset
    assert client.get("/redoc").status_code == 404  # ReDoc would load from a CDN


def test_docs_fall_back_to_a_page_built_from_the_schema(
    trained_node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(app_module, "swagger_ui_dir", lambda: None)
    page = embedded_client(trained_node).get("/docs")
    assert page.status_code == 200 and "://" not in page.text
    assert "<code>/api/swarm</code>" in page.text and "<code>/metrics</code>" in page.text


def test_swarm_route_shows_what_each_peer_refused_and_from_whom() -> None:
    import time

    from dht.heartbeat import Heartbeat
    from merge.identity import Identity

    alice, mallory = Identity.generate(), Identity.generate()
    observer = FakeObserver()
    reasons = {"bad_signature": 3, "update_rate": 9}
    beat = Heartbeat(
        peer_id=alice.peer_id,
        sent_at=time.time(),
        rejections=reasons,
        rejected_peers={mallory.peer_id: reasons},
    )
    observer.publish(beat, alice)
    (peer,) = standalone_client(observer).get("/api/swarm").json()["peers"]
    assert peer["rejections"] == reasons
    assert peer["rejected_peers"] == {mallory.peer_id: reasons}
