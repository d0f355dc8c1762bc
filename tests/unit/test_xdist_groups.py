"""The suite's xdist groups (tests/conftest.py): which group a test runs in, and the order the
groups are handed to the workers (the swarm tests at once, the unit tests last)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import (
    BESIDE_GROUP,
    GROUP_ORDER,
    PROCESS_GROUP,
    REPO,
    SINGLE_GROUP,
    UNIT_GROUP,
    group_of,
    next_group,
)


@dataclass
class FakeItem:
    path: Path
    markers: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> object | None:
        return name if name in self.markers else None


@pytest.mark.parametrize(
    ("path", "markers", "group"),
    [
        ("tests/unit/test_budget.py", set(), UNIT_GROUP),
        ("tests/unit/test_wait_budget.py", {"swarm"}, UNIT_GROUP),
        ("tests/swarm/test_groups.py", {"swarm"}, PROCESS_GROUP),
        ("tests/swarm/test_harness.py", {"swarm", "lone"}, SINGLE_GROUP),
        ("tests/swarm/test_fragments.py", {"swarm", "beside"}, BESIDE_GROUP),
        ("tests/dashboard/test_browser.py", {"swarm", "beside"}, BESIDE_GROUP),
        ("tests/swarm/test_hetero.py", {"swarm"}, PROCESS_GROUP),
        ("tests/node/test_cli.py", set(), SINGLE_GROUP),
        ("tests/test_docs.py", set(), SINGLE_GROUP),
    ],
)
def test_each_test_runs_in_the_group_of_what_it_starts(
    path: str, markers: set[str], group: str
) -> None:
    assert group_of(FakeItem(REPO / path, markers)) == group  # type: ignore[arg-type]


def test_the_single_tests_come_first_then_the_swarm_tests_then_the_unit_tests() -> None:
    # loadgroup's own queue, by size: the swarm tests would start only once a worker is free
    assert next_group([UNIT_GROUP, SINGLE_GROUP, PROCESS_GROUP, BESIDE_GROUP]) == SINGLE_GROUP
    assert next_group([UNIT_GROUP, BESIDE_GROUP, PROCESS_GROUP]) == PROCESS_GROUP
    # the light swarm tests before the unit tests: once a worker is niced it stays so, and
    # their nodes would inherit it
    assert next_group([UNIT_GROUP, BESIDE_GROUP]) == BESIDE_GROUP
    assert next_group([UNIT_GROUP]) == UNIT_GROUP
    assert next_group([]) is None


@given(st.sets(st.sampled_from(GROUP_ORDER)))
def test_the_next_group_is_the_first_queued_one_in_the_order(queued: set[str]) -> None:
    first = next_group(queued)
    assert first == min(queued, key=GROUP_ORDER.index, default=None)
