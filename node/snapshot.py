"""One read-only picture of a running node, for whatever shows it (the embedded dashboard).

A leaf module: readers depend on this, never on `node.runtime`, so nothing above the node
(dashboard/) needs the Node class and the node never hands out its mutable insides.
"""

from __future__ import annotations

from dataclasses import dataclass

from dht.heartbeat import Heartbeat
from dht.transfer_progress import ProgressReport


@dataclass(frozen=True)
class PeerSighting:
    """A peer as this node's swarm last saw it."""

    heartbeat: Heartbeat
    alive: bool
    last_seen_s: float
    """Seconds since its last heartbeat arrived."""


@dataclass(frozen=True)
class NodeStatus:
    run_id: str
    fingerprint: str
    own: Heartbeat
    """This node's heartbeat, built now (unsigned)."""
    peers: tuple[PeerSighting, ...]
    fetches: int
    """Update payloads fetched from peers (bounded history)."""
    fetched_bytes: int
    taken_at: float
    """Unix time of the snapshot."""
    state_download: ProgressReport | None = None
    """The running state download: bytes, rate, ETA (None: none running)."""
    fresh_peers_set_aside: int = 0
    """Live peers without an applied record here that the node does not act on (fresh keys
    beyond dht.membership's bound); counted among `peers` as alive all the same."""
    codec: str = ""
    """The codec the node sends its updates with: its last round's, or the one `--codec auto`
    picked for the next ("" where the node did not say)."""
    codec_auto: bool = False
    """Whether `--codec auto` picks it from the measured uplink (else `--codec` named it)."""
    uplink_bytes_per_s: float | None = None
    """This process's uplink as measured from its own sends (merge.codec_uplink.UplinkMeter;
    None until a send large enough to measure it)."""
