"""bench.fetch_causes: a run's whole fetches of group updates by cause, from its events."""

from __future__ import annotations

import json
from pathlib import Path

from bench.fetch_causes import load, summary


def test_whole_fetches_are_counted_by_cause_and_bytes_by_kind(tmp_path: Path) -> None:
    events = [
        {"event": "update_fetched", "author": "groups.0b1", "megabytes": 1.5, "cause": "summary"},
        {"event": "update_fetched", "author": "groups.0b1", "megabytes": 1.5,
         "cause": "in_order_state_differs"},
        {"event": "update_fetched", "author": "groups.0b10", "megabytes": 1.5, "cause": "summary"},
        {"event": "update_fetched", "author": "12D3KooWpeer", "megabytes": 0.5, "cause": "x"},
        {"event": "group_received", "kind": "slice", "megabytes": 0.25},
        {"event": "shard_round", "outcome": "applied", "applied": 3, "fallback_in_order": 0},
        {"event": "shard_round", "outcome": "state_differs", "applied": 0, "fallback_in_order": 1},
    ]  # fmt: skip
    (tmp_path / "n16").mkdir()
    text = "".join(json.dumps(e) + "\n" for e in events) + "not json\n"
    (tmp_path / "n16" / "node0.jsonl").write_text(text)
    got = summary(load(tmp_path))
    assert got["whole_fetches"] == 3 and got["whole_mb"] == 4.5
    assert got["by_cause"] == {"summary": [2, 3.0], "in_order_state_differs": [1, 1.5]}
    assert got["received_mb"] == {"whole updates": 4.5, "learner": 0.5, "group slice": 0.2}
    assert got["fetch_rounds"] == 2 and got["ids_by_shards"] == 3 and got["ids_in_order"] == 1
