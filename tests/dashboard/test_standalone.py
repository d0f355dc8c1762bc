"""The standalone data source: liveness, the timeline and goodput from signed heartbeats alone."""

from __future__ import annotations

import dataclasses

import pytest

from dashboard.history import History
from dashboard.settings import DashboardSettings
from dashboard.standalone import StandaloneSource
from dashboard.view import swarm_out
from dht.heartbeat import Heartbeat
from merge.allowlist import AllowList
from merge.identity import Identity
from node.status import print_status, status_document
from tests.dashboard.conftest import Clock, FakeObserver

SETTINGS = DashboardSettings(port=0, poll_period_s=2.0)


class Swarm:
    """Two signed peers, a and b, in two organizations, behind a fake DHT and a fake clock."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.observer = FakeObserver()
        self.history = History(SETTINGS)
        self.source = StandaloneSource(
            self.observer, "run", SETTINGS, self.history, clock=self.clock
        )
        self.ids = {name: Identity.generate() for name in ("a", "b")}
        self.beats: dict[str, Heartbeat] = {}

    def peer_id(self, name: str) -> str:
        return self.ids[name].peer_id

    def beat(self, name: str, **fields: object) -> None:
        """`name` sends a new heartbeat: its previous one with `fields` changed."""
        previous = self.beats.get(name) or Heartbeat(
            peer_id=self.peer_id(name), org=f"org-{name}", heartbeat_period_s=1.0
        )
        beat = dataclasses.replace(previous, sent_at=self.clock.now, **fields)  # type: ignore[arg-type]
        self.beats[name] = beat
        self.observer.publish(beat, self.ids[name])

    def read(self, after_s: float = 2.0) -> dict:
        self.clock.now += after_s
        state = self.source.refresh()
        assert state is not None
        return swarm_out(state).model_dump()


@pytest.fixture
def swarm() -> Swarm:
    return Swarm()


def test_goodput_counts_updates_that_every_live_replica_holds(swarm: Swarm) -> None:
    a, b = swarm.peer_id("a"), swarm.peer_id("b")
    swarm.beat("a", updates_published=4, merged_by_author={a: 4, b: 2})
    swarm.beat("b", updates_published=2, merged_by_author={a: 3, b: 2})

    totals = swarm.read()["totals"]

    # a's 4th update has not reached b yet: 3 + 2 of 6 published updates are everywhere.
    assert (totals["updates_merged"], totals["updates_published"]) == (5, 6)
    assert totals["goodput"] == pytest.approx(5 / 6, abs=1e-4)
    orgs = {o["org"]: o for o in swarm.read(0)["orgs"]}
    assert orgs["org-a"]["goodput"] == 0.75 and orgs["org-b"]["goodput"] == 1.0


def test_a_syncing_peer_does_not_pull_goodput_down(swarm: Swarm) -> None:
    a = swarm.peer_id("a")
    swarm.beat("a", updates_published=4, merged_by_author={a: 4})
    swarm.beat("b", state="syncing")

    assert swarm.read()["totals"]["goodput"] == 1.0


def test_a_silent_peer_is_marked_dead_and_leaves_the_timeline(swarm: Swarm) -> None:
    swarm.beat("a")
    swarm.beat("b")
    assert swarm.read()["totals"]["peers_alive"] == 2

    for _ in range(4):  # b falls silent: its last heartbeat stays in the DHT, unchanged
        swarm.beat("a")
        swarm.read()
    peers = {p["org"]: p for p in swarm.read(0)["peers"]}

    assert peers["org-a"]["alive"] and peers["org-a"]["state"] == "training"
    assert not peers["org-b"]["alive"] and peers["org-b"]["state"] == "dead"
    assert peers["org-b"]["last_seen_s"] == 8.0
    kinds = [(e.kind, e.peer_id) for e in swarm.history.to_out().timeline]
    assert kinds == [
        ("joined", swarm.peer_id("a")),
        ("joined", swarm.peer_id("b")),
        ("left", swarm.peer_id("b")),
    ]


def test_a_peer_that_comes_back_rejoins(swarm: Swarm) -> None:
    swarm.beat("a")
    swarm.read()
    swarm.read(10.0)
    swarm.beat("a", round=5)

    (peer,) = swarm.read()["peers"]

    assert peer["alive"] and peer["round"] == 5
    kinds = [e.kind for e in swarm.history.to_out().timeline]
    assert kinds == ["joined", "left", "joined"]


def test_new_rejections_in_heartbeats_become_failures_on_the_timeline(swarm: Swarm) -> None:
    swarm.beat("a", rejections={"bad_signature": 1})
    swarm.read()
    swarm.beat("a", rejections={"bad_signature": 3, "replay": 1})
    swarm.read()

    failure = swarm.history.to_out().timeline[-1]
    assert failure.kind == "rejected"
    assert failure.detail == "rejected 2 bad_signature, 1 replay"


def test_history_keeps_one_loss_point_per_round(swarm: Swarm) -> None:
    # Round 2 is first reported while it is being evaluated, with round 1's loss.
    for round_, loss in [(1, 3.0), (1, 3.0), (2, 3.0), (2, 2.5), (3, 2.0)]:
        swarm.beat("a", round=round_, val_loss=loss, num_applied=round_)
        swarm.read()

    history = swarm.history.to_out()

    (series,) = history.peers
    assert [(p.round, p.val_loss) for p in series.points] == [(1, 3.0), (2, 2.5), (3, 2.0)]
    assert [p.val_loss for p in history.swarm] == [3.0, 3.0, 3.0, 2.5, 2.0]
    # num_applied grew by 2 over the last 8 s: 15 per minute.
    assert history.merges_per_minute[-1].updates_per_min == pytest.approx(15.0)


def test_history_is_bounded(swarm: Swarm) -> None:
    small = DashboardSettings(port=0, history_points=5, peer_points=3, timeline_events=4)
    swarm.source.history = swarm.history = History(small)
    for round_ in range(1, 20):
        swarm.beat("a", round=round_)
        swarm.read(0.0)
        swarm.read(30.0)  # silent for long: a leaves, and rejoins with its next heartbeat

    history = swarm.history.to_out()
    assert len(history.swarm) == 5 and len(history.peers[0].points) == 3
    assert len(history.timeline) == 4
    assert len(swarm.history.to_out(max_points=2).swarm) == 2


def test_a_permissioned_dashboard_shows_listed_peers_under_the_files_orgs(swarm: Swarm) -> None:
    a = swarm.peer_id("a")
    swarm.source._allowlist = AllowList({a: "lab-from-file"})  # b is not listed
    swarm.beat("a", org="claimed-org")
    swarm.beat("b")

    peers = swarm.read()["peers"]

    assert [(p["peer_id"], p["org"]) for p in peers] == [(a, "lab-from-file")]


def test_status_shows_rejections_per_peer_and_reason(
    swarm: Swarm, capsys: pytest.CaptureFixture[str]
) -> None:
    b = swarm.peer_id("b")
    swarm.beat("a", rejections={"bad_signature": 3}, rejected_peers={b: {"bad_signature": 3}})
    snapshots = swarm.observer.snapshot("run")

    document = status_document("run", snapshots)
    print_status("run", snapshots, as_json=False)

    (row,) = document["runs"][0]["peers"]
    assert row["rejected_peers"] == {b: {"bad_signature": 3}}
    assert f"rejected {b[-12:]}: 3 bad_signature" in capsys.readouterr().out


def test_status_and_the_swarm_route_show_which_path_each_peer_is_on(
    swarm: Swarm, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # a terminal wide enough that no cell wraps
    swarm.beat("a", paths={"direct": 1, "holepunched": 0, "relayed": 2})
    swarm.beat("b")  # a peer of the previous version: no path counts
    snapshots = swarm.observer.snapshot("run")

    document = status_document("run", snapshots)
    print_status("run", snapshots, as_json=False)

    rows = {row["peer_id"]: row["paths"] for row in document["runs"][0]["peers"]}
    assert rows == {
        swarm.peer_id("a"): {"direct": 1, "holepunched": 0, "relayed": 2},
        swarm.peer_id("b"): {},
    }
    assert "1 direct, 2 relayed" in capsys.readouterr().out
    shown = {p["peer_id"]: p["paths"] for p in swarm.read()["peers"]}
    assert shown[swarm.peer_id("a")] == {"direct": 1, "holepunched": 0, "relayed": 2}
    assert shown[swarm.peer_id("b")] == {}


def test_status_and_the_swarm_route_show_each_peers_codec_and_uplink(
    swarm: Swarm, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")  # a terminal wide enough that no cell wraps
    swarm.beat("a", codec="topk", codec_auto=True, uplink_bytes_per_s=625000.0)
    swarm.beat("b")  # a peer of the previous version: none of the three
    snapshots = swarm.observer.snapshot("run")

    document = status_document("run", snapshots)
    print_status("run", snapshots, as_json=False)

    fields = ("codec", "codec_auto", "uplink_bytes_per_s")
    rows = {row["peer_id"]: tuple(row[f] for f in fields) for row in document["runs"][0]["peers"]}
    assert rows == {
        swarm.peer_id("a"): ("topk", True, 625000.0),
        swarm.peer_id("b"): (None, None, None),
    }
    assert "topk (auto) · 625.0 KB/s" in capsys.readouterr().out
    shown = {p["peer_id"]: tuple(p[f] for f in fields) for p in swarm.read()["peers"]}
    assert shown == rows
