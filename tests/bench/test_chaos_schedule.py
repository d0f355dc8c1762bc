"""The chaos harness's failure schedule: seeded, Poisson per node, never overlapping."""

from __future__ import annotations

import pytest

from bench.chaos import ChaosConfig, make_schedule


def test_the_failure_schedule_is_seeded_and_a_nodes_faults_never_overlap() -> None:
    config = ChaosConfig(nodes=4, duration_s=600, mtbf_s=60, seed=3)
    schedule = make_schedule(config)
    assert schedule == make_schedule(config)
    assert schedule != make_schedule(ChaosConfig(nodes=4, duration_s=600, mtbf_s=60, seed=4))
    assert 20 <= len(schedule) <= 60  # ~40 expected
    for node in range(4):
        own = [f for f in schedule if f.node == node]
        assert all(a.at_s + a.duration_s <= b.at_s for a, b in zip(own, own[1:], strict=False))
    assert {f.kind for f in schedule} == {"kill", "pause", "cut"}


def test_bad_chaos_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault kind or method"):
        ChaosConfig(kinds="kill,meteor")
    with pytest.raises(ValueError, match="--nodes"):
        ChaosConfig(nodes=1)
