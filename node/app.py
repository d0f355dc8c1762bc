"""The composition root: where a node's collaborators are built and wired together.

It is also the one seam between node/ and dashboard/ (which sits above node/ in the import
layers, see pyproject's [tool.importlinter]): no other module of node/ imports dashboard/.
The dashboard knows a node only as a callable returning its `node.snapshot.NodeStatus`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from dashboard.embedded import EmbeddedDashboard
from dashboard.settings import StandaloneConfig
from dashboard.standalone import serve
from node.config import JoinConfig
from node.events import EventLog
from node.snapshot import NodeStatus

__all__ = ["StandaloneConfig", "build_dashboard", "serve_dashboard"]


def build_dashboard(
    config: JoinConfig, peer_id: str, status: Callable[[], NodeStatus]
) -> EmbeddedDashboard | None:
    """`join --dashboard-port`: the node's own dashboard (None without the flag)."""
    if config.dashboard_port is None:
        return None
    return EmbeddedDashboard(
        host=config.dashboard_host,
        port=config.dashboard_port,
        token=config.dashboard_token,
        run_id=config.run_id,
        peer_id=peer_id,
        status=status,
    )


def serve_dashboard(config: StandaloneConfig, events: EventLog, stop: threading.Event) -> None:
    """`diloco-node dashboard`: the swarm's dashboard without training, until `stop`."""
    serve(config, events, stop)
