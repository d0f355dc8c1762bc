"""bench.scale's figures: what a run's events, heartbeats and samples add up to, one row per N,
and the extrapolation to `base` at 100 and 1000 nodes (see bench.scale for each figure)."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import TYPE_CHECKING, Any

from merge.sketch import relative_distance

if TYPE_CHECKING:
    from bench.scale_run import Sampler, Slot

RECEIVED_EVENTS = ("update_fetched", "state_downloaded", "realigned", "group_received")
"""Events whose `megabytes` a node received: updates, a joiner's state, a realignment's state
(counted since session 22: a settle's or a left-out member's download is bytes too) and a
group's in-group traffic."""


def agree(beats: list[Any]) -> bool:
    return len({h.applied_digest for h in beats}) == 1


def figures(
    slots: list[Slot], sampler: Sampler, kills: int, converge_s: float | None
) -> dict[str, Any]:
    n = len(slots)
    training = [beats for _, beats in sampler.samples if len(beats) >= 2]
    events = [e for slot in slots for child in slot.children for e in child.events]
    rounds_done = [e for e in events if e.get("event") == "round_done"]
    drifts = [e["drift"] for e in rounds_done if e.get("drift") is not None]
    per_round = []
    for slot in slots:
        slot_events = [e for child in slot.children for e in child.events]
        rounds = sum(e.get("event") == "round_done" for e in slot_events)
        received = sum(e["megabytes"] for e in slot_events if e.get("event") in RECEIVED_EVENTS)
        if rounds:
            per_round.append(received / rounds)
    fetched = [e["megabytes"] for e in events if e.get("event") == "update_fetched"]
    last_beats = sampler.converged_beats or next(
        (beats for _, beats in reversed(sampler.samples) if beats), []
    )  # the nodes have exited by the end: their last heartbeats while they lingered
    rss = [v / 1e6 for v in sampler.rss.values()]
    mb_per_round = statistics.mean(per_round) if per_round else 0.0
    return {
        "n": n,
        "kills": kills,
        "samples": len(training),
        "agree_share": round(sum(map(agree, training)) / max(len(training), 1), 3),
        "converged": converge_s is not None,
        "converge_s": converge_s,
        "max_drift": max(drifts) if drifts else None,
        "median_drift": round(statistics.median(drifts), 5) if drifts else None,
        "final_drift": final_drift(last_beats),
        "settled_drift": final_drift(sampler.settled_beats or []),
        "settle_s": sampler.settle_s,
        "rss_mb_mean": round(statistics.mean(rss), 1) if rss else None,
        "rss_mb_max": round(max(rss), 1) if rss else None,
        "update_mb": round(statistics.median(fetched), 4) if fetched else None,
        "mb_received_per_round": round(mb_per_round, 3),
        "mb_received_per_round_per_peer": round(mb_per_round / max(n - 1, 1), 4),
        "lost": sum(h.num_lost for h in last_beats),
        "need_state": sum(h.num_need_state for h in last_beats),
        "need_state_events": sum(e.get("event") == "update_needs_state" for e in events),
        "final_num_applied": sorted(h.num_applied for h in last_beats),
        "final_digests": len({h.applied_digest for h in last_beats}),
        "sized_differently": sized_differently([s.current.events for s in slots]),
        "rejections": dict(sum((Counter(h.rejections) for h in last_beats), Counter())),
        "shard_rounds": dict(  # --shard-fetch: each member's fetch rounds by outcome
            Counter(e["outcome"].split(" ")[0] for e in events if e.get("event") == "shard_round")
        ),
        "applied_by_shards": sum(e["applied"] for e in events if e.get("event") == "shard_round"),
        "fold_rounds_applied": sum(  # --fold: fetch rounds that applied their own group's update
            e.get("outcome") == "applied"
            and any(str(c).startswith(f"{e.get('group_key')}#") for c in e.get("candidates", ()))
            for e in events
            if e.get("event") == "shard_round"
        ),
        "applied_in_order_on_fallback": sum(  # a fetch round's fallback (session 18)
            e.get("fallback_in_order", 0) for e in events if e.get("event") == "shard_round"
        ),
        "slices_reused": sum(  # kept from an earlier fetch round (session 18)
            e.get("slices_reused", 0) for e in events if e.get("event") == "shard_round"
        ),
        **exit_figures([s.current.events for s in slots]),
    }


def exit_figures(per_node: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """The replicas as the nodes left them, from each node's own `stopped` event (its last
    process's): independent of the DHT observer, whose reads time out at load ~40 (16 nodes on
    2 cores). `converged_at_exit`: every node stopped on its own and all hold one applied set;
    `exit_drift`: the largest relative distance between sketches of one applied set."""
    stops = [
        next((e for e in reversed(es) if e.get("event") == "stopped"), None) for es in per_node
    ]
    final = [e for e in stops if e is not None and e.get("applied_digest")]
    digests = {e["applied_digest"] for e in final}
    return {
        "exit_reported": len(final),
        "exit_digests": len(digests),
        "exit_num_applied": sorted(e["num_applied"] for e in final),
        "exit_drift": _drift([(e["applied_digest"], e["sketch"]) for e in final]),
        "converged_at_exit": bool(final) and len(final) == len(per_node) and len(digests) == 1,
    }


def sized_differently(per_node: list[list[dict[str, Any]]]) -> dict[str, int]:
    """Update ids that the last processes of the nodes merged with different contributions
    (what drift between replicas with one applied set is made of): in all, and those whose
    learner count (merge.learners floor) or robust verdict (merge.robust) differed."""
    merged: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for events in per_node:
        for e in events:
            if e.get("event") == "update_merged":
                merged.setdefault((e["author"], e["seq"]), []).append(e)
    differ = [es for es in merged.values() if len({e["weight"] for e in es}) > 1]
    return {
        "ids_compared": sum(len(es) > 1 for es in merged.values()),
        "weight": len(differ),
        "learners": sum(len({e["learners"] for e in es}) > 1 for es in merged.values()),
        "robust": sum(len({e.get("robust") for e in es}) > 1 for es in merged.values()),
    }


def final_drift(beats: list[Any]) -> float | None:
    """Largest relative distance between two last sketches of replicas with one applied set.

    During training drift includes the momentum tail of updates applied in different orders
    (it shrinks as later updates fold it in); this is what stays once everyone stopped.
    """
    return _drift([(h.applied_digest, h.sketch) for h in beats])


def _drift(replicas: list[tuple[str, Any]]) -> float | None:
    """Largest relative distance between two (applied digest, sketch) of one applied set."""
    distances = [
        relative_distance(list(a), list(b))
        for i, (digest_a, a) in enumerate(replicas)
        for digest_b, b in replicas[i + 1 :]
        if digest_a == digest_b and a and b
    ]
    known = [d for d in distances if d is not None]
    return round(max(known), 5) if known else None


def extrapolate(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-node megabytes per round for `base` at 100 and 1000 nodes, gossiping full updates.

    Measured: the megabytes one node received per round per other node, for tiny. Scaled by
    base's parameter count over tiny's, times N - 1.
    """
    per_peer = [r["mb_received_per_round_per_peer"] for r in results if r["n"] > 1]
    if not per_peer or not any(r["update_mb"] for r in results):
        return {}  # nothing gossiped whole (learner groups): no all-to-all to extrapolate
    ratio = _num_params("base") / _num_params("tiny")
    measured = statistics.mean(per_peer)
    tiny_update_mb = statistics.median(r["update_mb"] for r in results if r["update_mb"])
    return {
        "base_update_mb": round(tiny_update_mb * ratio, 1),
        "measured_tiny_mb_per_round_per_peer": round(measured, 4),
        "mb_per_node_per_round": {n: round(measured * ratio * (n - 1), 1) for n in (100, 1000)},
    }


def _num_params(preset: str) -> int:
    import torch

    from node.model import build_model, model_config

    with torch.device("meta"):
        model = build_model(model_config(preset), 0)
    return sum(p.numel() for p in model.parameters())
