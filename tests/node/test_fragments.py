"""A node with --fragments publishes its fragments on schedule and resumes its fragment state."""

from __future__ import annotations

from pathlib import Path

from node.events import RecordingEventLog
from node.runtime import Node
from tests.node.test_training import _config


def test_fragment_updates_are_published_on_schedule_and_survive_a_restart(tmp_path: Path) -> None:
    config = dict(inner_steps=4, fragments=2, codec="int8", eval_batches=1)
    first_events = RecordingEventLog()
    first = Node(_config(tmp_path, "ckpt", max_rounds=2, **config), first_events)
    first.run()

    events = RecordingEventLog()
    resumed = Node(_config(tmp_path, "ckpt", max_rounds=3, **config), events)
    resumed.run()

    # Each run stops by --max-rounds and flushes both fragments' int8 residuals (bf16
    # fragment flushes, seqs after its rounds'), so the saved residual is empty.
    flushes = [[e["seq"] for e in log.of("residual_flushed")] for log in (first_events, events)]
    assert flushes == [[6], [10]]  # the event names the last seq of the P flushes
    assert events.of("resumed")[0]["num_applied"] == 6
    all_published = first_events.of("fragment_published") + events.of("fragment_published")
    published = [(e["round"], e["step"], e["fragment"], e["seq"]) for e in all_published]
    assert published == [(1, 2, 0, 1), (1, 4, 1, 2), (2, 2, 0, 3), (2, 4, 1, 4),
                         (3, 2, 0, 7), (3, 4, 1, 8)]  # fmt: skip
    assert resumed.replica.applied == {resumed.peer_id: list(range(1, 11))}
    outer = resumed.replica.state_dict()["outer"]["fragments"]  # type: ignore[index]
    assert [state["count"] for state in outer] == [3, 3]  # a flush is no outer round
    rounds = first_events.of("round_done") + events.of("round_done")
    assert [r["seq"] for r in rounds] == [2, 4, 8]
    final = events.of("evaluated")[-1]  # the final replica's (evaluations run beside training)
    assert final["round"] == 3
    assert final["val_loss"] < first_events.of("evaluated")[0]["val_loss"]
    residual = resumed.state_dict()["error_feedback"]["residual"]
    assert residual.shape == (resumed.num_params,) and not bool(residual.any())
