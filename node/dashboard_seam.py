"""The one seam between node/ and dashboard/ (which sits above node/ in the import layers, see
pyproject's [tool.importlinter]): no other module of node/ imports dashboard/. The dashboard
knows a node only as a callable returning its `node.snapshot.NodeStatus`.

A training node builds its dashboard beside training, after its first inner step: the page's
history (the pydantic models of its answers), fastapi and uvicorn cost ~0.5 s to import on an
idle machine and ~3 s under load, at every restart. Until then `NodeDashboard` keeps the
events the page shows (`started`, joins, rounds, ...) and hands them over, with the times they
were emitted at, when it is built. Its port is checked at once: a taken --dashboard-port is
one clear error before training.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dashboard.server import check_free  # sockets only: uvicorn loads when a server starts
from dashboard.settings import StandaloneConfig
from node.config import JoinConfig
from node.events import EventLog
from node.snapshot import NodeStatus

if TYPE_CHECKING:  # built beside training (NodeDashboard.build)
    from dashboard.embedded import EmbeddedDashboard, EmbeddedSource

__all__ = ["NodeDashboard", "StandaloneConfig", "build_dashboard", "serve_dashboard"]

DEFAULT_DASHBOARD_PORT = 8000
"""`join` serves its dashboard here unless --dashboard-port says otherwise (or it is taken)."""
EARLY_EVENTS = 1000
"""Events kept until the dashboard is built (a node emits a few dozen before its first step)."""


def build_dashboard(
    config: JoinConfig, peer_id: str, status: Callable[[], NodeStatus]
) -> NodeDashboard | None:
    """The node's own dashboard: on --dashboard-port, else on 8000 or any free port."""
    if not config.dashboard:
        return None
    return NodeDashboard(
        host=config.dashboard_host,
        port=DEFAULT_DASHBOARD_PORT if config.dashboard_port is None else config.dashboard_port,
        any_port_if_taken=config.dashboard_port is None,
        access=dashboard_access(config),
        token=config.dashboard_token,
        run_id=config.run_id,
        peer_id=peer_id,
        status=status,
    )


def dashboard_access(config: JoinConfig) -> str:
    """Who may open the dashboard, as the console line under its URL says it."""
    if config.dashboard_token_file is not None:
        return f"token in {config.dashboard_token_file}"
    if config.dashboard_token is not None:
        return "token given by --dashboard-token"
    if ipaddress.ip_address(config.dashboard_host).is_loopback:
        return "no token: open to this machine only"
    return "no token: open to the network"


def serve_dashboard(config: StandaloneConfig, events: EventLog, stop: threading.Event) -> None:
    """`diloco-node dashboard`: the swarm's dashboard without training, until `stop`."""
    from dashboard.standalone import serve  # fastapi: imported by the command that serves it

    serve(config, events, stop)


class NodeDashboard:
    """A node's dashboard: its port checked now, built (`build`) and served (`start`) beside
    training; the events teed to it before it is built wait, bounded, with their times."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        any_port_if_taken: bool,
        access: str,
        token: str | None,
        run_id: str,
        peer_id: str,
        status: Callable[[], NodeStatus],
        clock: Callable[[], float] = time.time,
    ) -> None:
        try:
            check_free(host, port)
        except OSError as exc:
            if not any_port_if_taken:
                raise OSError(f"{exc}; pass another --dashboard-port (0: any free port)") from None
        self.access = access
        self._embedded_args: dict[str, Any] = dict(
            host=host, port=port, any_port_if_taken=any_port_if_taken, token=token,
            run_id=run_id, peer_id=peer_id, status=status,
        )  # fmt: skip
        self._clock = clock
        self._early: deque[tuple[str, dict[str, Any], float]] = deque(maxlen=EARLY_EVENTS)
        self._built: EmbeddedDashboard | None = None
        self._lock = threading.Lock()  # the hand-over: an event goes to the buffer or the page
        self._building = threading.Lock()  # one dashboard, whoever asks first

    def tee(self, events: EventLog) -> EventLog:
        """The node's event log, unchanged, with its events also kept for the page."""
        return _Teed(events, self)

    def record(self, event: str, fields: dict[str, Any]) -> None:
        t = self._clock()
        with self._lock:
            built = self._built
            if built is None:
                self._early.append((event, fields, t))
                return
        built.record(event, fields, t=t)

    def build(self) -> EmbeddedDashboard:
        """The page's source and history (imported now, not on the start path), holding every
        event recorded so far; built once."""
        with self._building:
            if self._built is None:
                from dashboard.embedded import EmbeddedDashboard

                built = EmbeddedDashboard(**self._embedded_args)
                with self._lock:  # short: the training thread may be emitting
                    for event, fields, t in self._early:
                        built.record(event, fields, t=t)
                    self._early.clear()
                    self._built = built
            return self._built

    @property
    def source(self) -> EmbeddedSource:
        """The page's data source, for a test or a tool that reads it unserved."""
        return self.build().source

    def start(self) -> str:
        """Serve the page; its URL once it answers. OSError if its port was taken since."""
        return self.build().start()

    def stop(self) -> None:
        if self._built is not None:
            self._built.stop()


class _Teed:
    """An EventLog that passes every event on unchanged and records it for the dashboard."""

    def __init__(self, inner: EventLog, dashboard: NodeDashboard) -> None:
        self._inner = inner
        self._dashboard = dashboard

    def emit(self, event: str, **fields: Any) -> None:
        self._inner.emit(event, **fields)
        self._dashboard.record(event, fields)

    def progress(self, **fields: Any) -> None:
        self._inner.progress(**fields)

    def close(self) -> None:
        self._inner.close()
