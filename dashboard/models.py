"""Response models of the JSON API: the field names scripts may rely on."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from dht.reachability import PathKind

Mode = Literal["embedded", "standalone"]
PeerState = Literal["syncing", "training", "idle", "dead"]
TimelineKind = Literal["joined", "left", "rejected", "info"]


class _Model(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True, frozen=True, defer_build=True)


class PeerOut(_Model):
    peer_id: str
    org: str
    state: PeerState
    """The state the peer last reported, or dead once it is silent for three heartbeats."""
    alive: bool
    round: int
    updates_published: int
    """Updates this peer authored and published (its latest seq)."""
    updates_merged: int
    """Updates (own and others') this peer merged since it started."""
    tokens_per_s: float
    loss: float | None
    """Training loss of its last round."""
    staleness_mean: float
    """Mean staleness of the updates it merged."""
    last_seen_s: float
    """Seconds since its latest heartbeat arrived."""
    val_loss: float | None
    """Validation loss of its replica after its last round."""
    num_applied: int
    """Updates in its replica's applied set."""
    drift: float | None
    """Largest relative distance of its replica to a peer's with the same applied set."""
    device: str
    version: str
    uptime_s: float
    local: bool
    """True for the node that serves this dashboard (embedded mode)."""
    rejections: dict[str, int] = {}
    """What this peer refused, by reason (updates, heartbeats, streams, DHT records)."""
    rejected_peers: dict[str, dict[str, int]] = {}
    """The peers whose input this peer refused most: peer id -> reason -> count."""
    paths: dict[PathKind, int] = {}
    """Its connected peers per path: direct, holepunched (a relayed connection upgraded by hole
    punching), relayed (through a circuit relay). Empty from a peer that does not report it."""
    codec: str | None = None
    """The codec it sends its updates with; null from a peer that does not report it (an
    earlier version)."""
    codec_auto: bool | None = None
    """Whether `--codec auto` picked `codec` from its measured uplink; null when not reported."""
    uplink_bytes_per_s: float | None = None
    """Its uplink as measured from its own sends, bytes per second; null until measured or
    when not reported."""
    num_lost: int = 0
    """Updates it declared lost: published, but no live peer could give it them."""
    num_need_state: int = 0
    """Updates it wants that no live peer offers but a live peer's state holds: they wait for a
    state download, not lost (0 from a peer that does not report it)."""


class Totals(_Model):
    peers_alive: int
    tokens_per_s: float
    """Sum over live peers."""
    updates_merged: int
    """Updates that every live, synced replica holds (the numerator of goodput)."""
    goodput: float | None
    """updates_merged / updates_published; null before the first update is published."""
    drift: float | None
    """Largest drift any live peer reports."""
    peers_known: int
    """Live and dead peers this dashboard has seen."""
    bytes_sent: int
    """Bytes the live peers sent to peers since they started (their heartbeats' sum)."""
    bytes_received: int
    """Bytes the live peers received from peers since they started."""
    updates_published: int
    """Updates published by every peer seen, live or dead."""
    val_loss: float | None
    """Mean validation loss of the live replicas."""
    fresh_peers_set_aside: int | None = None
    """Live peers without an applied record at the node serving this dashboard that it does not
    act on (fresh keys beyond its bound: it pushes nothing to them and does not count them);
    counted in `peers_alive` all the same. Null standalone (no node of its own)."""


class OrgOut(_Model):
    org: str
    peers_alive: int
    peers_known: int
    tokens_per_s: float
    updates_published: int
    updates_merged: int
    goodput: float | None


class StalenessBucket(_Model):
    label: str
    min: int
    max: int | None
    count: int
    """Merges of updates this stale, summed over every peer seen."""


class PageOut(_Model):
    """Which peers `peers` holds: page `number` of `pages`, `size` each, `total` in all."""

    number: int
    size: int
    pages: int
    total: int
    """Live and dead peers seen, in the order: live first, this node, org, peer id."""


class QuantilesOut(_Model):
    """Nearest-rank quantiles of one figure over the live peers that report it."""

    count: int
    min: float
    p10: float
    median: float
    p90: float
    max: float


class SummaryOut(_Model):
    """Swarm-wide aggregates over the live peers, the same size at any swarm size."""

    peers: int
    learners: int
    """Live peers that count as learners when an update is sized: not idle, and some peer
    seen merged one of their updates."""
    groups: int
    """Learner groups the live peers would form (docs/scale.md): the learner count once
    groups are wired into training."""
    group_bits: int
    states: dict[str, int]
    loss: QuantilesOut | None
    val_loss: QuantilesOut | None
    rounds: QuantilesOut | None
    shards: dict[str, int]
    """Heartbeat shard prefix -> heartbeats read there (standalone; empty embedded)."""
    lost: int = 0
    """Updates the live peers declared lost, summed over their heartbeats."""
    need_state: int = 0
    """Updates the live peers wait for a state download to bring (not lost), summed."""
    peers_need_state: int = 0
    """Live peers waiting for a state for at least one update."""


class RejectionOut(_Model):
    """What the peers seen refused from one offender, summed over the peers reporting it."""

    offender: str
    total: int
    reasons: dict[str, int]
    reporters: list[str]
    """The reporting peers (the first MAX_REPORTERS of them, by peer id)."""
    reporters_total: int


class SwarmOut(_Model):
    run_id: str
    fingerprint: str
    mode: Mode
    generated_at: float
    """Unix time of the swarm reading this answer describes."""
    peers: list[PeerOut]
    """One page of the peers seen (`page`); the other fields cover every peer."""
    totals: Totals
    orgs: list[OrgOut]
    staleness_histogram: list[StalenessBucket]
    page: PageOut
    summary: SummaryOut
    rejections: list[RejectionOut]
    """The offenders refused most (at most MAX_REJECTION_ROWS), most refused first."""


class StateDownloadOut(_Model):
    """A state download: this node's replica coming from a donor."""

    peer_id: str
    """The donor."""
    num_bytes: int
    total_bytes: int | None
    """What the donor announced (null before its first answer)."""
    bytes_per_s: float | None
    """Over the last few seconds (null at the start)."""
    eta_s: float | None
    """Seconds left at that rate (null when unknown)."""
    elapsed_s: float


class NodeOut(_Model):
    peer_id: str
    org: str
    run_id: str
    fingerprint: str
    state: PeerState
    round: int
    num_applied: int
    updates_published: int
    updates_merged: int
    tokens_per_s: float
    loss: float | None
    val_loss: float | None
    staleness_mean: float
    drift: float | None
    uptime_s: float
    device: str
    version: str
    maddrs: list[str]
    peers_alive: int
    """Peers other than this node whose heartbeats are current."""
    fresh_peers_set_aside: int = 0
    """Of those, live peers without an applied record here that this node does not act on
    (fresh keys beyond its bound: it pushes nothing to them and does not count them)."""
    rejections: dict[str, int]
    """Rejected updates and heartbeats by reason (bad signature, replay, stale, ...)."""
    rejected_total: int
    rejected_peers: dict[str, dict[str, int]] = {}
    """The peers this node rejected most: peer id -> reason -> count."""
    fetches: int
    """Update payloads fetched from peers."""
    fetched_megabytes: float
    state_download: StateDownloadOut | None = None
    """The state download running now (null: none)."""
    codec: str = ""
    """The codec this node sends its updates with (its last round's, or the one --codec auto
    picked for the next)."""
    codec_auto: bool = False
    """Whether --codec auto picks it from the measured uplink (else --codec named it)."""
    uplink_bytes_per_s: float | None = None
    """This node's uplink as measured from its own sends (null: not measured yet)."""


class SwarmPoint(_Model):
    t: float
    """Unix time of the sample."""
    peers_alive: int
    tokens_per_s: float
    num_applied: int
    """Largest applied count among live replicas."""
    updates_merged: int
    updates_published: int
    goodput: float | None
    drift: float | None
    val_loss: float | None
    fresh_peers_set_aside: int | None = None
    """As in Totals (null standalone)."""


class PeerPoint(_Model):
    t: float
    round: int
    loss: float | None
    val_loss: float | None
    tokens_per_s: float


class PeerSeries(_Model):
    peer_id: str
    org: str
    points: list[PeerPoint]


class RatePoint(_Model):
    t: float
    updates_per_min: float


class TimelineEvent(_Model):
    t: float
    kind: TimelineKind
    peer_id: str
    detail: str


class HistoryOut(_Model):
    swarm: list[SwarmPoint]
    peers: list[PeerSeries]
    merges_per_minute: list[RatePoint]
    """Growth of the applied set over the preceding minute, per sample."""
    timeline: list[TimelineEvent]
    """Oldest first."""


class Health(_Model):
    status: Literal["ok", "stale"]
    mode: Mode
    peers_alive: int
    data_age_s: float | None
    """Seconds since the swarm was last read successfully; null before the first reading."""
