"""What judges and sizes updates besides the replica survives a restart.

A node restarted with an empty learner floor sized its own first updates as a lone learner's
while its peers raised them to the floor, and with empty robust windows it judged updates its
peers clipped: their replicas, with one applied set, stayed apart for good (bench.scale,
N = 2 with one restart: settled drift 0.27). Both are checkpointed with the replica.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.learners import LearnerFloor
from tests.unit.test_merge_pipeline import ALICE, BOB, make_pipeline, make_update

AUTHORS = ["alice", "bob", "carol", "dave"]
event = st.tuples(st.sampled_from(AUTHORS), st.integers(1, 12))


@settings(max_examples=80, deadline=None)
@given(
    before=st.lists(event, max_size=40),
    after=st.lists(event, max_size=20),
    window=st.integers(1, 16),
)
def test_a_restored_floor_decides_as_the_one_it_was_saved_from(
    before: list[tuple[str, int]], after: list[tuple[str, int]], window: int
) -> None:
    saved = LearnerFloor(window)
    for author, claim in before:
        saved.applied(author, claim)
    restored = LearnerFloor(window)
    restored.load_state_dict(saved.state_dict())
    for author, claim in after:
        assert [saved.floor(a) for a in [*AUTHORS, "erin"]] == [
            restored.floor(a) for a in [*AUTHORS, "erin"]
        ]
        saved.applied(author, claim)
        restored.applied(author, claim)
    assert restored.state_dict() == saved.state_dict()


@pytest.mark.parametrize(
    "state",
    [
        None,
        {"recent": "alice", "claims": {}},
        {"recent": ["alice"], "claims": {"alice": 0}},
        {"recent": ["alice"], "claims": {"alice": True}},
        {"recent": ["alice"], "claims": {"bob": 2}},
        {"recent": [1], "claims": {}},
    ],
)
def test_a_malformed_floor_state_is_refused_and_changes_nothing(state: object) -> None:
    floor = LearnerFloor(8)
    floor.applied("alice", 3)
    before = floor.state_dict()
    with pytest.raises(ValueError):
        floor.load_state_dict(state)
    assert floor.state_dict() == before


def test_a_pipelines_robust_windows_and_floor_come_back_with_its_state() -> None:
    pipeline = make_pipeline()
    for seq in range(6):
        for who in (ALICE, BOB):
            assert pipeline.submit(make_update(who, seq=seq, learners=2)).accepted
    fresh = make_pipeline()
    fresh.load_state_dict(pipeline.state_dict())
    assert fresh.state_dict() == pipeline.state_dict()
    assert fresh.robust.median_norm() == pipeline.robust.median_norm() is not None
    assert fresh.learner_floor.floor(ALICE.peer_id) == 2


def test_a_checkpoint_from_before_the_merge_state_leaves_the_pipeline_as_it_is() -> None:
    pipeline = make_pipeline()
    pipeline.load_state_dict(None)
    assert pipeline.state_dict() == make_pipeline().state_dict()
    with pytest.raises(ValueError, match="robust filter states"):
        pipeline.load_state_dict({"robust": [], "learner_floor": {"recent": [], "claims": {}}})
