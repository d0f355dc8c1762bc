"""What runs beside training (issue 23) starts once the first inner step is in, never before
it and never for a node that stops first; evaluations arrive as events, one per round; the
dashboard is imported and served only then, and shows the events emitted before."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from node.events import RecordingEventLog
from node.runtime import Node
from tests.conftest import REPO
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


DASHBOARD_AFTER_FIRST_STEP = """
import json, sys, time
from pathlib import Path
from node.events import RecordingEventLog
from node.runtime import Node
from tests.node.test_training import _config

PAGE = ("dashboard.history", "dashboard.models", "fastapi", "uvicorn")


class Watched(RecordingEventLog):
    def emit(self, event, **fields):
        loaded = [m for m in PAGE if m in sys.modules]
        super().emit(event, loaded_at_emit=loaded, emitted_at=time.time(), **fields)


events = Watched()
node = Node(_config(Path(sys.argv[1]), "ckpt", max_rounds=1, dashboard_port=0), events)
node.run()
timeline = node.dashboard.build().history.to_out().timeline
print(json.dumps({"events": events.events, "timeline": [e.model_dump() for e in timeline]}))
"""


def test_the_dashboard_is_imported_and_served_after_the_first_step_and_shows_what_came_before(
    tmp_path: Path,
) -> None:
    """In a process of its own (what a process has imported is the point): nothing of the
    page is imported up to the first inner step; the page then serves, and its timeline has
    the `started` event emitted before it existed, at the time it was emitted."""
    done = subprocess.run(
        [sys.executable, "-c", DASHBOARD_AFTER_FIRST_STEP, str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    names = [e.get("name", e["event"]) for e in out["events"]]
    first_step, served = names.index("first_batch"), names.index("dashboard")
    assert first_step < served
    assert all(e["loaded_at_emit"] == [] for e in out["events"][: first_step + 1])
    assert "dashboard.history" in out["events"][served]["loaded_at_emit"]
    started = out["events"][names.index("started")]
    (shown,) = [e for e in out["timeline"] if e["detail"].startswith("this node started")]
    assert abs(shown["t"] - started["emitted_at"]) < 0.5
    assert shown["t"] < out["events"][served]["emitted_at"]
