"""From heartbeats to what the dashboard shows: peers, totals, goodput, organizations.

Pure functions over a `SwarmState` (the heartbeats a data source read at one moment), so both
data sources and every route compute the same figures the same way.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

from dashboard.models import (
    Mode,
    OrgOut,
    PageOut,
    PeerOut,
    PeerState,
    QuantilesOut,
    RejectionOut,
    StalenessBucket,
    SummaryOut,
    SwarmOut,
    Totals,
)
from dht.heartbeat import STALENESS_BUCKETS, Heartbeat
from dht.pages import MAX_PAGE_SIZE, page_bounds
from dht.swarm_pages import Quantiles, summarize

DEFAULT_PAGE_SIZE = 50
MAX_REJECTION_ROWS = 50
MAX_REPORTERS = 16


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
    shards: dict[str, int] = field(default_factory=dict)
    """Heartbeat shard prefix -> heartbeats read there (standalone only)."""
    fresh_set_aside: int | None = None
    """Live peers the serving node sets aside (embedded only: node.snapshot.NodeStatus)."""

    @property
    def alive(self) -> list[Heartbeat]:
        return [p.heartbeat for p in self.peers if p.alive]


def swarm_out(state: SwarmState, page: int = 1, page_size: int | None = None) -> SwarmOut:
    """Every figure over every peer seen, and page `page` of `page_size` peers (all of them,
    up to MAX_PAGE_SIZE, when `page_size` is None)."""
    ordered = sorted(state.peers, key=peer_order)
    size = page_size or max(1, min(len(ordered), MAX_PAGE_SIZE))
    shown = page_bounds(len(ordered), page, size)
    return SwarmOut(
        run_id=state.run_id,
        fingerprint=state.fingerprint,
        mode=state.mode,
        generated_at=round(state.taken_at, 3),
        peers=[peer_out(p) for p in ordered[shown.start : shown.stop]],
        totals=totals(state),
        orgs=orgs(state),
        staleness_histogram=staleness_histogram(state),
        page=PageOut(number=shown.number, size=shown.size, pages=shown.pages, total=shown.total),
        summary=summary_out(state),
        rejections=rejections(state.peers),
    )


def peer_order(record: PeerRecord) -> tuple[bool, bool, str, str]:
    """Live first, then this node, then by organization and peer id (the page's order)."""
    h = record.heartbeat
    return (not record.alive, not record.local, h.org, h.peer_id)


def summary_out(state: SwarmState) -> SummaryOut:
    s = summarize(state.run_id, state.alive, state.shards)
    return SummaryOut(
        peers=s.peers,
        learners=s.learners,
        groups=s.groups,
        group_bits=s.group_bits,
        states=s.states,
        loss=_quantiles_out(s.loss),
        val_loss=_quantiles_out(s.val_loss),
        rounds=_quantiles_out(s.rounds),
        shards=s.shards,
        lost=s.lost,
        need_state=s.need_state,
        peers_need_state=s.peers_need_state,
    )


def _quantiles_out(q: Quantiles | None) -> QuantilesOut | None:
    if q is None:
        return None
    v = q.values
    return QuantilesOut(
        count=q.count, min=v[0.0], p10=v[0.1], median=v[0.5], p90=v[0.9], max=v[1.0]
    )


def rejections(records: Iterable[PeerRecord]) -> list[RejectionOut]:
    """What peers refused, summed per offender and reason over every peer seen; the
    MAX_REJECTION_ROWS offenders refused most (each peer reports its few worst offenders)."""
    reasons: dict[str, dict[str, int]] = {}
    reporters: dict[str, list[str]] = {}
    for record in records:
        h = record.heartbeat
        for offender, counts in h.rejected_peers.items():
            row = reasons.setdefault(offender, {})
            for reason, count in counts.items():
                row[reason] = row.get(reason, 0) + count
            reporters.setdefault(offender, []).append(h.peer_id)
    ordered = sorted(reasons, key=lambda o: (-sum(reasons[o].values()), o))
    return [
        RejectionOut(
            offender=offender,
            total=sum(reasons[offender].values()),
            reasons=dict(sorted(reasons[offender].items(), key=lambda kv: (-kv[1], kv[0]))),
            reporters=sorted(reporters[offender])[:MAX_REPORTERS],
            reporters_total=len(reporters[offender]),
        )
        for offender in ordered[:MAX_REJECTION_ROWS]
    ]


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
        codec=h.codec,
        codec_auto=h.codec_auto,
        uplink_bytes_per_s=h.uplink_bytes_per_s,
        num_lost=h.num_lost,
        num_need_state=h.num_need_state,
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
        fresh_peers_set_aside=state.fresh_set_aside,
    )


def goodput_counts(
    authors: Iterable[Heartbeat],
    alive: list[Heartbeat],
    everywhere: dict[str, int] | None = None,
) -> tuple[int, int]:
    """(updates every live replica holds, updates published), over the given authors.

    Goodput is the first divided by the second: the share of the published pseudo-gradients
    (the compute peers shared) that made it into the model everywhere. For each author, live
    or dead, `published` is the `updates_published` of its latest heartbeat, and `merged` is
    the smallest `merged_by_author[author]` over the live peers that have finished syncing
    (capped at `published`). Updates still in flight count as not merged yet, so goodput is a
    lower bound at any instant; updates rejected, lost with a dead author or skipped never
    count. A peer that is still syncing is left out: it has not downloaded the replica yet.
    """
    if everywhere is None:
        everywhere = merged_everywhere([h for h in alive if h.state != "syncing"])
    merged = published = 0
    for author in authors:
        published += author.updates_published
        merged += min(everywhere.get(author.peer_id, 0), author.updates_published)
    return merged, published


def merged_everywhere(replicas: list[Heartbeat]) -> dict[str, int]:
    """Author -> the fewest of its updates any of `replicas` merged, for authors every replica
    merged from (absent: 0). One pass over the replicas' counts, not authors x replicas."""
    fewest: dict[str, int] = {}
    holders: dict[str, int] = {}
    for h in replicas:
        for author, count in h.merged_by_author.items():
            fewest[author] = min(count, fewest.get(author, count))
            holders[author] = holders.get(author, 0) + 1
    return {a: n for a, n in fewest.items() if holders[a] == len(replicas)}


def orgs(state: SwarmState) -> list[OrgOut]:
    """Per-organization breakdown: hardware, throughput and how much of its work is used."""
    alive = state.alive
    everywhere = merged_everywhere([h for h in alive if h.state != "syncing"])
    members_of: dict[str, list[PeerRecord]] = {}
    for record in state.peers:
        members_of.setdefault(record.heartbeat.org, []).append(record)
    out = []
    for org in sorted(members_of):
        members = members_of[org]
        merged, published = goodput_counts([p.heartbeat for p in members], alive, everywhere)
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
