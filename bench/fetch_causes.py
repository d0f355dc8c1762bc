"""Why a group run's nodes fetched other groups' updates whole, from `bench.scale --events-dir`
(docs/scale.md, Session 23).

    python -m bench.fetch_causes RUN_EVENTS_DIR [RUN_EVENTS_DIR ...]

Per run: every `update_fetched` of a learner group's update (author `groups.*`) by its
`cause` (count and MB: dht.catchup `Fetch.cause`, the shard fetch's hand-over reason,
`in_order_<outcome>` for a fetch round's in-order fallback), the megabytes received by kind
(what bench.scale's `mb_per_node_per_round` sums), the fetch rounds by outcome and the ids
they applied by shards. Reads JSON lines only; runs nothing.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

RECEIVED = ("update_fetched", "state_downloaded", "realigned", "group_received")


def load(folder: Path) -> list[dict[str, Any]]:
    """Every event of every process under `folder` (bench.procs save_events' files)."""
    events = []
    for path in sorted(folder.rglob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return events


def _kind(e: dict[str, Any]) -> str:
    name = e.get("event", "")
    if name == "update_fetched":
        return "whole updates" if str(e.get("author", "")).startswith("groups.") else "learner"
    if name == "group_received":
        return f"group {e.get('kind')}"
    return name


def summary(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures above, for one run's events."""
    whole = [
        e
        for e in events
        if e.get("event") == "update_fetched" and str(e.get("author", "")).startswith("groups.")
    ]
    by_cause: Counter[str] = Counter()
    mb_by_cause: Counter[str] = Counter()
    for e in whole:
        cause = e.get("cause", "unknown")
        by_cause[cause] += 1
        mb_by_cause[cause] += e.get("megabytes", 0.0)
    received: Counter[str] = Counter()
    for e in events:
        if e.get("event") in RECEIVED:
            received[_kind(e)] += e.get("megabytes", 0.0)
    rounds = [e for e in events if e.get("event") == "shard_round"]
    outcomes = Counter(e.get("outcome") for e in rounds)
    return {
        "whole_fetches": len(whole),
        "whole_mb": round(sum(mb_by_cause.values()), 1),
        "by_cause": {c: [n, round(mb_by_cause[c], 1)] for c, n in by_cause.most_common()},
        "received_mb": {k: round(v, 1) for k, v in received.most_common()},
        "fetch_rounds": len(rounds),
        "outcomes": dict(outcomes.most_common()),
        "ids_by_shards": sum(e.get("applied", 0) for e in rounds if e.get("outcome") == "applied"),
        "ids_in_order": sum(e.get("fallback_in_order", 0) for e in rounds),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="+")
    for folder in parser.parse_args(argv).folders:
        print(json.dumps({"run": str(folder), **summary(load(folder))}, indent=1))


if __name__ == "__main__":
    main()
