"""The dashboard inside a node (`join`, unless --no-dashboard): reads the node's status snapshot.

It knows the node only as a callable returning a `node.snapshot.NodeStatus`, so it never
imports `node.runtime` nor touches the node's attributes. A node builds it beside training
(node.dashboard_seam), which hands it the events emitted until then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any, cast

from dashboard.history import EventRecorder, History
from dashboard.models import Mode, NodeOut, PeerState, StateDownloadOut
from dashboard.server import DashboardServer
from dashboard.settings import DashboardSettings
from dashboard.sources import PolledSource
from dashboard.view import PeerRecord, SwarmState
from dht.transfer_progress import ProgressReport
from node.snapshot import NodeStatus

StatusFn = Callable[[], NodeStatus]


class EmbeddedSource(PolledSource):
    """The node's own heartbeat plus every peer its swarm has seen (PeerView liveness)."""

    mode: Mode = "embedded"

    def __init__(
        self, run_id: str, status: StatusFn, settings: DashboardSettings, history: History
    ) -> None:
        super().__init__(run_id, settings, history)
        self._status = status

    def read(self) -> SwarmState:
        status = self._status()
        peers = [PeerRecord(status.own, alive=True, last_seen_s=0.0, local=True)]
        peers += [PeerRecord(p.heartbeat, p.alive, p.last_seen_s) for p in status.peers]
        return SwarmState(
            status.run_id, status.fingerprint, self.mode, peers, status.taken_at,
            fresh_set_aside=status.fresh_peers_set_aside,
        )  # fmt: skip

    def node(self) -> NodeOut:
        """Read now, not at the last poll: the local node is cheap to ask."""
        state = self.state()
        status = self._status()
        own = status.own
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
            fresh_peers_set_aside=status.fresh_peers_set_aside,
            rejections=dict(sorted(own.rejections.items())),
            rejected_total=sum(own.rejections.values()),
            rejected_peers=own.rejected_peers,
            fetches=status.fetches,
            fetched_megabytes=round(status.fetched_bytes / 1e6, 3),
            state_download=_state_download(status.state_download),
            codec=status.codec,
            codec_auto=status.codec_auto,
            uplink_bytes_per_s=status.uplink_bytes_per_s,
        )


class EmbeddedDashboard:
    """The page's data source and history; served by `start`. Its port was checked free when
    the node was composed: one taken since fails `start` (or, with any_port_if_taken, another
    port serves)."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        token: str | None,
        run_id: str,
        peer_id: str,
        status: StatusFn,
        any_port_if_taken: bool = False,
    ) -> None:
        self.settings = DashboardSettings(host=host, port=port, token=token)
        self.any_port_if_taken = any_port_if_taken
        self.history = History(self.settings)
        self.source = EmbeddedSource(run_id, status, self.settings, self.history)
        self._recorder = EventRecorder(self.history, peer_id)
        self._server: DashboardServer | None = None

    def record(self, event: str, fields: dict[str, Any], *, t: float) -> None:
        """One of the node's events, emitted at unix time t, kept if the page shows it."""
        self._recorder.record(event, fields, t=t)

    def start(self) -> str:
        # Here, not at import: fastapi and uvicorn cost ~a third of `import torch`, and a node
        # starts its dashboard beside training, after its first inner step (docs/goodput.md).
        from dashboard.app import create_app

        app = create_app(self.source, self.settings)
        try:
            self._server = DashboardServer(app, self.settings.host, self.settings.port)
        except OSError:
            if not self.any_port_if_taken:
                raise
            self._server = DashboardServer(app, self.settings.host, 0)
        self.source.start()
        return self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
        self.source.stop()


def _state_download(progress: ProgressReport | None) -> StateDownloadOut | None:
    if progress is None:
        return None
    return StateDownloadOut(**asdict(progress))
