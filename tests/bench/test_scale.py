"""bench.scale's account of what drift between replicas with one applied set is made of."""

from __future__ import annotations

from typing import Any

from bench.scale import sized_differently


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
