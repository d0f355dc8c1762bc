"""The dashboard inside a node (`join --dashboard-port`): reads the Node object directly."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, cast

from dashboard.app import create_app
from dashboard.history import History, HistoryTee
from dashboard.models import Mode, NodeOut, PeerState
from dashboard.server import DashboardServer, check_free
from dashboard.settings import DashboardSettings
from dashboard.sources import PolledSource
from dashboard.view import PeerRecord, SwarmState
from node.events import EventLog

if TYPE_CHECKING:
    from node.runtime import Node


class EmbeddedSource(PolledSource):
    """The node's own heartbeat plus every peer its swarm has seen (PeerView liveness)."""

    mode: Mode = "embedded"

    def __init__(self, node: Node, settings: DashboardSettings, history: History) -> None:
        super().__init__(node.config.run_id, settings, history)
        self._node = node

    def read(self) -> SwarmState:
        node = self._node
        own = node.heartbeat()
        now = time.time()
        peers = [PeerRecord(own, alive=True, last_seen_s=0.0, local=True)]
        if node.swarm is not None:
            period = node.swarm.config.heartbeat_period_s
            for view in list(node.swarm.peers.values()):
                peers.append(PeerRecord(view.heartbeat, view.alive(period), now - view.last_seen))
        return SwarmState(node.config.run_id, node.fingerprint, self.mode, peers, now)

    def node(self) -> NodeOut:
        """Read now, not at the last poll: the local node is cheap to ask."""
        state = self.state()
        own = self._node.heartbeat()
        fetches = list(self._node.swarm.fetches) if self._node.swarm is not None else []
        return NodeOut(
            peer_id=own.peer_id,
            org=own.org,
            run_id=state.run_id,
            fingerprint=state.fingerprint,
            state=cast(PeerState, own.state),
            round=own.round,
            num_applied=own.num_applied,
            updates_published=own.updates_published,
            updates_merged=own.updates_merged,
            tokens_per_s=own.tokens_per_s,
            loss=own.loss,
            val_loss=own.val_loss,
            staleness_mean=own.staleness_mean,
            drift=own.drift,
            uptime_s=own.uptime_s,
            device=own.device,
            version=own.version,
            maddrs=own.maddrs,
            peers_alive=sum(p.alive and not p.local for p in state.peers),
            rejections=dict(sorted(own.rejections.items())),
            rejected_total=sum(own.rejections.values()),
            fetches=len(fetches),
            fetched_megabytes=round(sum(f.num_bytes for f in fetches) / 1e6, 3),
        )


class EmbeddedDashboard:
    """Created with the node (the port is checked then), served once the node has joined."""

    def __init__(self, node: Node) -> None:
        config = node.config
        assert config.dashboard_port is not None
        self.settings = DashboardSettings(
            host=config.dashboard_host, port=config.dashboard_port, token=config.dashboard_token
        )
        check_free(self.settings.host, self.settings.port)
        self.history = History(self.settings)
        self.source = EmbeddedSource(node, self.settings, self.history)
        self._local_peer_id = node.peer_id
        self._server: DashboardServer | None = None

    def tee(self, events: EventLog) -> EventLog:
        """The node's event log, unchanged, with its notable events also kept for the page."""
        return HistoryTee(events, self.history, self._local_peer_id)

    def start(self) -> str:
        self._server = DashboardServer(
            create_app(self.source, self.settings), self.settings.host, self.settings.port
        )
        self.source.start()
        return self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        self.source.stop()
