"""Rendering of `diloco-node status`: a table for people, JSON for scripts."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from dht.observer import PeerStatus, SwarmSnapshot
from dht.reachability import paths_label
from dht.swarm_pages import Quantiles, SwarmSummary
from node.status_args import DEFAULT_PAGE_SIZE, PageRequest


def peer_row(peer: PeerStatus) -> dict[str, Any]:
    h = peer.heartbeat
    return {
        "peer_id": h.peer_id,
        "org": h.org,
        "state": h.state,
        "round": h.round,
        "tokens_per_s": h.tokens_per_s,
        "loss": h.loss,
        "val_loss": h.val_loss,
        "applied": h.num_applied,
        "lost": h.num_lost,
        "need_state": h.num_need_state,
        "paths": dict(h.paths),
        "codec": h.codec,
        "codec_auto": h.codec_auto,
        "uplink_bytes_per_s": h.uplink_bytes_per_s,
        "updates_published": h.updates_published,
        "updates_merged": h.updates_merged,
        "drift": h.drift,
        "realigned": h.num_realigned,
        "device": h.device,
        "version": h.version,
        "last_seen_s": round(peer.last_seen_s, 1),
        "rejections": dict(h.rejections),
        "rejected_peers": {p: dict(reasons) for p, reasons in h.rejected_peers.items()},
    }


def bytes_label(count: float) -> str:
    """A byte count in decimal units, as the dashboard writes it: 625.0 KB, 12 B."""
    units = ("B", "KB", "MB", "GB", "TB")
    i = 0
    while abs(count) >= 1000 and i < len(units) - 1:
        count, i = count / 1000, i + 1
    return f"{count:.1f} {units[i]}" if i else f"{round(count)} {units[i]}"


def codec_label(codec: str | None, auto: bool | None, uplink_bytes_per_s: float | None) -> str:
    """What a peer sends with and its measured uplink, as its heartbeat says: "topk (auto) ·
    625.0 KB/s"; "?" for what it does not say (an uplink not measured yet: "bf16 · ?"), and
    alone for a heartbeat without either (a node of an earlier version)."""
    if codec is None and uplink_bytes_per_s is None:
        return "?"
    sends = "?" if codec is None else codec + (" (auto)" if auto else "")
    uplink = "?" if uplink_bytes_per_s is None else f"{bytes_label(uplink_bytes_per_s)}/s"
    return f"{sends} · {uplink}"


def run_config(summary: str) -> dict[str, Any]:
    """A run record's settings as an object; a peer's unreadable record says so, not crashes."""
    try:
        config = json.loads(summary)
    except ValueError:
        config = None
    return config if isinstance(config, dict) else {"unreadable": summary[:200]}


def quantiles_out(q: Quantiles | None) -> dict[str, Any] | None:
    if q is None:
        return None
    names = {0.0: "min", 0.5: "median", 1.0: "max"}
    return {
        "count": q.count,
        **{names.get(k, f"p{round(100 * k)}"): v for k, v in q.values.items()},
    }


def summary_document(summary: SwarmSummary) -> dict[str, Any]:
    return {
        "peers": summary.peers,
        "learners": summary.learners,
        "groups": summary.groups,
        "group_bits": summary.group_bits,
        "states": summary.states,
        "loss": quantiles_out(summary.loss),
        "val_loss": quantiles_out(summary.val_loss),
        "rounds": quantiles_out(summary.rounds),
        "shards": summary.shards,
        "lost": summary.lost,
        "need_state": summary.need_state,
        "peers_need_state": summary.peers_need_state,
    }


def status_document(
    run_id: str | None,
    snapshots: list[SwarmSnapshot],
    page: PageRequest = (1, DEFAULT_PAGE_SIZE),
) -> dict[str, Any]:
    """`run_id` only when the user named one (else the runs were found through the DHT).
    Each run: its swarm-wide `summary`, and one `page` of its `peers`."""
    named = {} if run_id is None else {"run_id": run_id}
    runs = []
    for snap in snapshots:
        shown, peers = snap.page(*page)
        runs.append(
            {
                "run_id": snap.run_id,
                "fingerprint": snap.fingerprint,
                "config": run_config(snap.run_summary),
                "summary": summary_document(snap.summary()),
                "page": {"number": shown.number, "size": shown.size, "pages": shown.pages},
                "peers": [peer_row(p) for p in peers],
            }
        )
    return {**named, "runs": runs}


def summary_line(summary: SwarmSummary) -> str:
    """The swarm in one line: peers, learners, groups, the loss spread, the shards read."""
    parts = [
        f"{summary.peers} peers",
        ", ".join(f"{n} {state}" for state, n in summary.states.items() if n),
        f"{summary.learners} learners",
        f"{summary.groups} learner groups (of peers)",
    ]
    loss = summary.val_loss or summary.loss
    if loss is not None:
        which = "val loss" if summary.val_loss is not None else "loss"
        v = loss.values
        parts.append(f"{which} p10/median/p90 {v[0.1]:.4f}/{v[0.5]:.4f}/{v[0.9]:.4f}")
    parts.append(missing_label(summary.lost, summary.need_state, summary.peers_need_state))
    if summary.shards:
        parts.append(f"heartbeats in {len(summary.shards)} shards")
    return " · ".join(p for p in parts if p)


def missing_label(lost: int, need_state: int, peers: int) -> str:
    """Updates the swarm misses: "3 updates lost, 85 waiting for a state (on 1 peer)"."""
    label = f"{lost} update{'' if lost == 1 else 's'} lost"
    if need_state:
        label += f", {need_state} waiting for a state (on {peers} peer{'' if peers == 1 else 's'})"
    return label


def lost_cell(lost: int, need_state: int) -> str:
    """A peer's row: "3" lost, "3 +85" with 85 more waiting for a state."""
    return f"{lost} +{need_state}" if need_state else str(lost)


def print_status(
    run_id: str | None,
    snapshots: list[SwarmSnapshot],
    *,
    as_json: bool,
    page: PageRequest = (1, DEFAULT_PAGE_SIZE),
) -> None:
    if as_json:
        print(json.dumps(status_document(run_id, snapshots, page)))
        return
    console = Console()
    if not snapshots:
        wanted = "any run" if run_id is None else f"run '{run_id}'"
        console.print(f"no live peers train {wanted} in this swarm")
    for snap in snapshots:
        shown, peers = snap.page(*page)
        console.print(summary_line(snap.summary()), markup=False, highlight=False)
        title = f"run '{snap.run_id}' ({snap.fingerprint[:12]}): " + (
            f"peers {shown.start + 1}-{shown.stop} of {shown.total} "
            f"(page {shown.number}/{shown.pages})"
            if shown.total
            else "no peers"
        )
        table = Table(title=title)
        for column in (
            "peer",
            "org",
            "state",
            "round",
            "tokens/s",
            "loss",
            "applied",
            "lost +wait",
            "paths",
            "codec",
            "seen",
        ):
            table.add_column(column, justify="left" if column in ("peer", "org") else "right")
        for peer in peers:
            row = peer_row(peer)
            loss = row["val_loss"] if row["val_loss"] is not None else row["loss"]
            table.add_row(
                row["peer_id"][-12:],
                row["org"],
                row["state"],
                str(row["round"]),
                f"{row['tokens_per_s']:,.0f}",
                "-" if loss is None else f"{loss:.4f}",
                str(row["applied"]),
                lost_cell(row["lost"], row["need_state"]),
                paths_label(row["paths"]),
                codec_label(row["codec"], row["codec_auto"], row["uplink_bytes_per_s"]),
                f"{row['last_seen_s']:.0f}s ago",
            )
        console.print(table)
        if any(p.heartbeat.num_need_state for p in peers):
            console.print("lost +wait: +N updates wait for a state download (not lost)")
        if shown.number < shown.pages:
            console.print(f"next: --page {shown.number + 1} (--page-size {shown.size})")
        _print_rejections(console, peers)


def _print_rejections(console: Console, peers: list[PeerStatus]) -> None:
    """Who rejected whom and why: each peer's (of this page) most rejected peers, per reason."""
    lines = [
        f"  {p.heartbeat.peer_id[-12:]} rejected {offender[-12:]}: "
        + ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
        for p in peers
        for offender, reasons in p.heartbeat.rejected_peers.items()
    ]
    if lines:
        console.print("rejections (peer, offender, reasons):")
        console.print("\n".join(lines), markup=False, highlight=False)
