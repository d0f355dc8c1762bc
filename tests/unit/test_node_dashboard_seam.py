"""node.dashboard_seam: a node's dashboard, built beside training, shows the events the node
emitted before it existed, at the times they were emitted, each once."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from node.dashboard_seam import NodeDashboard
from node.events import RecordingEventLog
from node.snapshot import NodeStatus

LOCAL = "12D3KooWlocal"


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def no_status() -> NodeStatus:
    raise AssertionError("the history is read, not the node's status")


def dashboard(port: int = 0, any_port_if_taken: bool = False, **kw: Any) -> NodeDashboard:
    return NodeDashboard(
        host="127.0.0.1", port=port, any_port_if_taken=any_port_if_taken, access="test",
        token=None, run_id="run", peer_id=LOCAL, status=no_status, **kw,
    )  # fmt: skip


def test_events_before_the_dashboard_is_built_show_at_the_time_they_were_emitted() -> None:
    clock = Clock(100.0)
    page = dashboard(clock=clock)
    inner = RecordingEventLog()
    events = page.tee(inner)
    events.emit("started", round=3, val_loss=None)
    clock.now = 101.0
    events.emit("peer_joined", peer_id="12D3KooWpeer", org="other")
    clock.now = 200.0
    history = page.build().history
    clock.now = 201.0
    events.emit("round_done", round=4, loss=2.5, val_loss=None, tokens_per_s=10.0)

    out = history.to_out()
    assert [(e.t, e.kind, e.peer_id, e.detail) for e in out.timeline] == [
        (100.0, "joined", LOCAL, "this node started training at round 3"),
        (101.0, "joined", "12D3KooWpeer", "org other"),
    ]
    (series,) = out.peers
    assert [(p.t, p.round, p.loss) for p in series.points] == [(201.0, 4, 2.5)]
    assert [e["event"] for e in inner.events] == ["started", "peer_joined", "round_done"]


def test_events_emitted_while_it_is_built_are_each_kept_once_in_order() -> None:
    page = dashboard()
    events = page.tee(RecordingEventLog())
    num_events = 400  # under the timeline's 500
    halfway = threading.Event()

    def emit_all() -> None:
        for i in range(num_events):
            events.emit("peer_joined", peer_id=f"peer{i}", org="")
            if i == num_events // 2:
                halfway.set()

    emitter = threading.Thread(target=emit_all)
    emitter.start()
    halfway.wait(10)
    history = page.build().history
    emitter.join(10)

    peers = [e.peer_id for e in history.to_out().timeline]
    assert peers == [f"peer{i}" for i in range(num_events)]


def test_a_taken_port_is_one_clear_error_unless_any_port_will_do() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"127.0.0.1:{port}: .*pass another --dashboard-port"):
            dashboard(port)
        assert dashboard(port, any_port_if_taken=True).access == "test"
