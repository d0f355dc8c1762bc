"""From heartbeats to what the dashboard shows: peers, totals, goodput, organizations.

Pure functions over a `SwarmState` (the heartbeats a data source read at one moment), so both
data sources and every route compute the same figures the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from dashboard.models import (
    Mode,
    OrgOut,
    PeerOut,
    PeerState,
    StalenessBucket,
    SwarmOut,
    Totals,
)
from dht.heartbeat import STALENESS_BUCKETS, Heartbeat


@dataclass(frozen=True)
class PeerRecord:
    heartbeat: Heartbeat
    alive: bool
    last_seen_s: float
    local: bool = False


@dataclass(frozen=True)
class SwarmState:
    run_id: str
    fingerprint: str
    mode: Mode
    peers: list[PeerRecord]
    taken_at: float
    """Unix time of the reading."""

    @property
    def alive(self) -> list[Heartbeat]:
        return [p.heartbeat for p in self.peers if p.alive]


def swarm_out(state: SwarmState) -> SwarmOut:
    return SwarmOut(
        run_id=state.run_id,
        fingerprint=state.fingerprint,
        mode=state.mode,
        generated_at=round(state.taken_at, 3),
        peers=[peer_out(p) for p in state.peers],
        totals=totals(state),
        orgs=orgs(state),
        staleness_histogram=staleness_histogram(state),
    )


def peer_out(record: PeerRecord) -> PeerOut:
    h = record.heartbeat
    return PeerOut(
        peer_id=h.peer_id,
        org=h.org,
        state=cast(PeerState, h.state) if record.alive else "dead",
        alive=record.alive,
        round=h.round,
        updates_published=h.updates_published,
        updates_merged=h.updates_merged,
        tokens_per_s=h.tokens_per_s,
        loss=h.loss,
        staleness_mean=h.staleness_mean,
        last_seen_s=round(max(0.0, record.last_seen_s), 1),
        val_loss=h.val_loss,
        num_applied=h.num_applied,
        drift=h.drift,
        device=h.device,
        version=h.version,
        uptime_s=h.uptime_s,
        local=record.local,
        rejections=dict(sorted(h.rejections.items())),
        rejected_peers={peer: dict(reasons) for peer, reasons in h.rejected_peers.items()},
        paths=dict(h.paths),
    )


def totals(state: SwarmState) -> Totals:
    alive = state.alive
    merged, published = goodput_counts([p.heartbeat for p in state.peers], alive)
    drifts = [h.drift for h in alive if h.drift is not None]
    val_losses = [h.val_loss for h in alive if h.val_loss is not None]
    return Totals(
        peers_alive=len(alive),
        tokens_per_s=round(sum(h.tokens_per_s for h in alive), 1),
        updates_merged=merged,
        goodput=_ratio(merged, published),
        drift=max(drifts) if drifts else None,
        peers_known=len(state.peers),
        bytes_sent=sum(h.bytes_sent for h in alive),
        bytes_received=sum(h.bytes_received for h in alive),
        updates_published=published,
        val_loss=round(statistics.fmean(val_losses), 6) if val_losses else None,
    )


def goodput_counts(authors: Iterable[Heartbeat], alive: list[Heartbeat]) -> tuple[int, int]:
    """(updates every live replica holds, updates published), over the given authors.

    Goodput is the first divided by the second: the share of the published pseudo-gradients
    (the compute peers shared) that made it into the model everywhere. For each author, live
    or dead, `published` is the `updates_published` of its latest heartbeat, and `merged` is
    the smallest `merged_by_author[author]` over the live peers that have finished syncing
    (capped at `published`). Updates still in flight count as not merged yet, so goodput is a
    lower bound at any instant; updates rejected, lost with a dead author or skipped never
    count. A peer that is still syncing is left out: it has not downloaded the replica yet.
    """
    replicas = [h for h in alive if h.state != "syncing"]
    merged = published = 0
    for author in authors:
        published += author.updates_published
        if replicas:
            everywhere = min(h.merged_by_author.get(author.peer_id, 0) for h in replicas)
            merged += min(everywhere, author.updates_published)
    return merged, published


def orgs(state: SwarmState) -> list[OrgOut]:
    """Per-organization breakdown: hardware, throughput and how much of its work is used."""
    alive = state.alive
    out = []
    for org in sorted({p.heartbeat.org for p in state.peers}):
        members = [p for p in state.peers if p.heartbeat.org == org]
        merged, published = goodput_counts([p.heartbeat for p in members], alive)
        out.append(
            OrgOut(
                org=org,
                peers_alive=sum(p.alive for p in members),
                peers_known=len(members),
                tokens_per_s=round(sum(p.heartbeat.tokens_per_s for p in members if p.alive), 1),
                updates_published=published,
                updates_merged=merged,
                goodput=_ratio(merged, published),
            )
        )
    return out


def staleness_histogram(state: SwarmState) -> list[StalenessBucket]:
    """Merges per staleness bucket, summed over every peer seen (each counts its own merges)."""
    counts = [0] * len(STALENESS_BUCKETS)
    for record in state.peers:
        for i, count in enumerate(record.heartbeat.staleness_histogram[: len(counts)]):
            counts[i] += count
    return [
        StalenessBucket(label=_bucket_label(i), min=low, max=_bucket_max(i), count=counts[i])
        for i, low in enumerate(STALENESS_BUCKETS)
    ]


def _bucket_max(i: int) -> int | None:
    return STALENESS_BUCKETS[i + 1] - 1 if i + 1 < len(STALENESS_BUCKETS) else None


def _bucket_label(i: int) -> str:
    low, high = STALENESS_BUCKETS[i], _bucket_max(i)
    if high is None:
        return f"{low}+"
    return str(low) if high == low else f"{low}-{high}"


def _ratio(numerator: int, denominator: int) -> float | None:
    return round(numerator / denominator, 4) if denominator else None
