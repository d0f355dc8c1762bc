"""Rendering of `diloco-node status`: a table for people, JSON for scripts."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from dht.observer import PeerStatus, SwarmSnapshot
from dht.reachability import paths_label


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
        "paths": dict(h.paths),
        "updates_published": h.updates_published,
        "updates_merged": h.updates_merged,
        "drift": h.drift,
        "device": h.device,
        "version": h.version,
        "last_seen_s": round(peer.last_seen_s, 1),
        "rejections": dict(h.rejections),
        "rejected_peers": {p: dict(reasons) for p, reasons in h.rejected_peers.items()},
    }


def run_config(summary: str) -> dict[str, Any]:
    """A run record's settings as an object; a peer's unreadable record says so, not crashes."""
    try:
        config = json.loads(summary)
    except ValueError:
        config = None
    return config if isinstance(config, dict) else {"unreadable": summary[:200]}


def status_document(run_id: str | None, snapshots: list[SwarmSnapshot]) -> dict[str, Any]:
    """`run_id` only when the user named one (else the runs were found through the DHT)."""
    named = {} if run_id is None else {"run_id": run_id}
    return {
        **named,
        "runs": [
            {
                "run_id": snap.run_id,
                "fingerprint": snap.fingerprint,
                "config": run_config(snap.run_summary),
                "peers": [peer_row(p) for p in snap.peers],
            }
            for snap in snapshots
        ],
    }


def print_status(run_id: str | None, snapshots: list[SwarmSnapshot], *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(status_document(run_id, snapshots)))
        return
    console = Console()
    if not snapshots:
        wanted = "any run" if run_id is None else f"run '{run_id}'"
        console.print(f"no live peers train {wanted} in this swarm")
    for snap in snapshots:
        title = f"run '{snap.run_id}' ({snap.fingerprint[:12]}): {len(snap.peers)} peers"
        table = Table(title=title)
        for column in (
            "peer",
            "org",
            "state",
            "round",
            "tokens/s",
            "loss",
            "applied",
            "paths",
            "seen",
        ):
            table.add_column(column, justify="left" if column in ("peer", "org") else "right")
        for peer in snap.peers:
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
                paths_label(row["paths"]),
                f"{row['last_seen_s']:.0f}s ago",
            )
        console.print(table)
        _print_rejections(console, snap)


def _print_rejections(console: Console, snap: SwarmSnapshot) -> None:
    """Who rejected whom and why: each peer's most rejected peers, per reason."""
    lines = [
        f"  {p.heartbeat.peer_id[-12:]} rejected {offender[-12:]}: "
        + ", ".join(f"{n} {reason}" for reason, n in sorted(reasons.items()))
        for p in snap.peers
        for offender, reasons in p.heartbeat.rejected_peers.items()
    ]
    if lines:
        console.print("rejections (peer, offender, reasons):")
        console.print("\n".join(lines), markup=False, highlight=False)
