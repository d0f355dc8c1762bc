"""What runs beside training (issue 23) starts once the first inner step is in, never before
it and never for a node that stops first; evaluations arrive as events, one per round."""

from __future__ import annotations

from pathlib import Path

from node.events import RecordingEventLog
from node.runtime import Node
from tests.node.test_training import _config


def test_what_runs_beside_training_starts_after_the_first_inner_step(tmp_path: Path) -> None:
    events = RecordingEventLog()
    node = Node(_config(tmp_path, "ckpt", max_rounds=2, dashboard=False), events)
    seen_at_start: list[list[str]] = []
    node.trainer.beside_training.append(
        lambda: seen_at_start.append([e.get("name", e["event"]) for e in events.events])
    )
    node.run()

    (seen,) = seen_at_start  # started once
    assert "first_batch" in seen and "round_done" not in seen
    # At start, then rounds as they end (a waiting one may be replaced by a newer), the last
    # one always: the node waits for it before it stops.
    evaluated = [e["round"] for e in events.of("evaluated")]
    assert evaluated[0] == 0 and evaluated[-1] == 2 and evaluated == sorted(set(evaluated))
    assert events.of("round_done")[-1]["round"] == 2


def test_a_node_stopped_before_its_first_step_starts_nothing_beside(tmp_path: Path) -> None:
    events = RecordingEventLog()
    node = Node(_config(tmp_path, "ckpt", max_rounds=2, dashboard=False), events)
    started: list[bool] = []
    node.trainer.beside_training.append(lambda: started.append(True))
    node.request_stop()
    node.run()

    assert started == [] and events.of("evaluated") == []
    assert events.of("stopped")[0]["reason"] == "interrupted"
