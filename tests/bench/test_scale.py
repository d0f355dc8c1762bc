"""bench.scale's account of what drift between replicas with one applied set is made of."""

from __future__ import annotations

from typing import Any

import pytest

from bench.scale_figures import exit_figures, sized_differently


def merged(author: str, seq: int, weight: float, learners: int, robust: str | None = None) -> Any:
    return {"event": "update_merged", "author": author, "seq": seq, "weight": weight,
            "learners": learners, "robust": robust}  # fmt: skip


def test_ids_merged_alike_everywhere_count_nothing() -> None:
    a = [merged("x", 1, 0.5, 2), merged("y", 1, 0.5, 2), {"event": "round_done"}]
    assert sized_differently([a, list(a)]) == {
        "ids_compared": 2, "weight": 0, "learners": 0, "robust": 0,
    }  # fmt: skip


def test_a_learner_floor_or_a_verdict_that_differs_is_counted() -> None:
    a = [merged("x", 1, 0.5, 2), merged("y", 1, 0.5, 2), merged("z", 4, 0.5, 2)]
    b = [merged("x", 1, 0.25, 4), merged("y", 1, 0.5, 2, "norm_outlier")]
    assert sized_differently([a, b]) == {
        "ids_compared": 2, "weight": 1, "learners": 1, "robust": 1,
    }  # fmt: skip


def _stopped(digest: str, num: int, sketch: list[float]) -> dict[str, object]:
    return {"event": "stopped", "applied_digest": digest, "num_applied": num, "sketch": sketch}


def test_nodes_that_left_on_one_applied_set_and_point_converged_at_exit() -> None:
    a = [{"event": "started"}, _stopped("d1", 7, [1.0, 2.0])]
    figures = exit_figures([a, list(a), [_stopped("d1", 7, [1.0, 2.0])]])
    assert figures == {
        "exit_reported": 3,
        "exit_digests": 1,
        "exit_num_applied": [7, 7, 7],
        "exit_drift": 0.0,
        "converged_at_exit": True,
    }


def test_a_node_that_never_stopped_or_another_applied_set_is_not_convergence() -> None:
    killed = [{"event": "started"}]  # its last process was killed: no `stopped`
    one = exit_figures([[_stopped("d1", 7, [1.0, 0.0])], killed])
    assert one["exit_reported"] == 1 and not one["converged_at_exit"]
    two = exit_figures([[_stopped("d1", 7, [1.0, 0.0])], [_stopped("d2", 8, [1.0, 1.0])]])
    assert two["exit_digests"] == 2 and two["exit_drift"] is None
    assert not two["converged_at_exit"]


def test_exit_drift_is_the_largest_distance_within_one_applied_set() -> None:
    per_node = [[_stopped("d1", 7, [1.0, 0.0])], [_stopped("d1", 7, [1.1, 0.0])]]
    assert exit_figures(per_node)["exit_drift"] == pytest.approx(0.1 / 1.1, abs=1e-5)
