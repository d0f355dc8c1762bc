"""The suite's xdist groups (tests/conftest.py): which group a test runs in, and the order the
groups are handed to the workers (the swarm tests at once, the unit tests last)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

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
    GroupsInOrder,
    group_of,
    next_group,
    work_unit,
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


def test_a_unit_test_file_is_a_work_unit_of_its_own_and_the_other_groups_whole() -> None:
    assert work_unit("tests/unit/test_a.py::test_x[1]", UNIT_GROUP) == "unit:tests/unit/test_a.py"
    assert work_unit("tests/swarm/test_b.py::test_y", PROCESS_GROUP) == PROCESS_GROUP
    assert next_group(["unit:tests/unit/test_a.py", BESIDE_GROUP, "unit:b"]) == BESIDE_GROUP
    assert next_group(["unit:tests/unit/test_a.py", "unit:b"]) == "unit:tests/unit/test_a.py"


@dataclass(eq=False)
class Worker:
    """What xdist's scheduler calls on a worker: the tests sent to it, in order."""

    name: str
    sent: list[int] = field(default_factory=list)
    done: list[int] = field(default_factory=list)
    shutting_down: bool = False

    @property
    def gateway(self) -> SimpleNamespace:
        return SimpleNamespace(id=self.name)

    def send_runtest_some(self, indices: list[int]) -> None:
        self.sent += indices

    def shutdown(self) -> None:
        self.shutting_down = True


def ids(group: str, path: str, count: int) -> list[str]:
    return [f"{path}::test_{i}@{group}" for i in range(count)]


def test_the_swarm_worker_takes_the_unit_files_left_once_its_swarm_tests_end() -> None:
    collection = (
        ids(UNIT_GROUP, "tests/unit/test_a.py", 5)
        + ids(SINGLE_GROUP, "tests/node/test_c.py", 4)
        + ids(PROCESS_GROUP, "tests/swarm/test_s.py", 4)
        + ids(UNIT_GROUP, "tests/unit/test_b.py", 3)
        + ids(BESIDE_GROUP, "tests/swarm/test_f.py", 3)
        + ids(UNIT_GROUP, "tests/unit/test_d.py", 4)
    )
    config = SimpleNamespace(
        getvalue=lambda name: ["2*popen"], option=SimpleNamespace(loadscopereorder=True)
    )
    scheduler = GroupsInOrder(config)  # type: ignore[arg-type]
    single, swarm = Worker("gw1"), Worker("gw0")
    for worker in (single, swarm):
        scheduler.add_node(worker)  # type: ignore[arg-type]
        scheduler.add_node_collection(worker, collection)  # type: ignore[arg-type]
    scheduler.schedule()

    def groups(worker: Worker) -> list[str]:
        return [collection[i].split("::")[0].rsplit("/", 1)[1] for i in worker.sent]

    def finish(worker: Worker, count: int) -> None:
        """The worker's next `count` tests end, each reported as xdist reports it."""
        for index in [i for i in worker.sent if i not in worker.done][:count]:
            worker.done.append(index)
            scheduler.mark_test_complete(worker, index)  # type: ignore[arg-type]

    assert set(groups(single)) == {"test_c.py"} and set(groups(swarm)) == {"test_s.py"}
    finish(single, 4)  # the single tests end first: the beside group, then a unit file
    assert groups(single)[4:] == ["test_f.py"] * 3
    finish(single, 1)  # two beside tests left: the unit file with the most tests
    assert groups(single)[7:] == ["test_a.py"] * 5
    finish(swarm, 2)  # two swarm tests left: the swarm worker takes the next unit file
    assert groups(swarm)[4:] == ["test_d.py"] * 4
    finish(swarm, 6)  # and the last one, before the other worker is done with its own
    assert groups(swarm)[8:] == ["test_b.py"] * 3
    assert scheduler.workqueue == {}
