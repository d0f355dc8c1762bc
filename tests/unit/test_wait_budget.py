"""Every real-process test's timeout covers the waits it can make one after another.

Otherwise pytest-timeout kills the test in the middle of a wait and the report says "Timeout"
instead of which wait hung and what the node printed.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from tests.timeouts import SETUP_S, START_S, covering
from tests.wait_budget import budgets, global_timeout_s, module_budgets

REPO = Path(__file__).resolve().parents[2]
DEFAULT_S = 300.0


def budget_of(source: str, name: str = "test_it") -> tuple[float, float]:
    found = {b.name: b for b in budgets(textwrap.dedent(source), DEFAULT_S)}[name]
    return found.waits_s, found.timeout_s


def test_every_real_process_test_has_a_timeout_that_covers_its_waits() -> None:
    paths = sorted([*REPO.glob("tests/swarm/test_*.py"), *REPO.glob("tests/node/test_*.py")])
    default_s = global_timeout_s(REPO / "pyproject.toml")

    short = [
        f"{path.relative_to(REPO)}::{b.name} waits up to {b.waits_s:.0f} s,"
        f" timeout {b.timeout_s:.0f} s"
        + (f", bounds not from constants: {b.unknown}" if b.unknown else "")
        for path, b in module_budgets(paths, default_s)
        if not b.covered
    ]

    assert len(paths) > 20
    assert not short, "mark these @pytest.mark.timeout(covering(...)):\n" + "\n".join(short)


def test_waits_add_up_one_after_another_and_a_mark_from_the_constants_covers_them() -> None:
    source = """
        import pytest
        from tests.timeouts import START_S, covering
        MERGE_S = 200

        def test_it(node):
            node.wait_listening(START_S)
            node.wait_for(lambda e: True, MERGE_S, "merged")
            node.wait_for_event("stopped", 60)

        @pytest.mark.timeout(covering(START_S, MERGE_S, 60))
        def test_marked(node):
            test_it(node)
    """
    assert budget_of(source) == (START_S + 200 + 60, DEFAULT_S)
    assert budget_of(source, "test_marked") == (START_S + 200 + 60, START_S + 260 + SETUP_S)


def test_helpers_loops_subprocesses_and_deadlines_count() -> None:
    source = """
        import subprocess, time
        STEP_S = 10

        def wait_merged(node, author, timeout_s=STEP_S):
            node.wait_for(lambda e: e.author == author, timeout_s, "merged")

        def test_it(a, b):
            for node in (a, b, a):
                wait_merged(node, "x")
            wait_merged(a, "y", timeout_s=100)
            for _ in range(4):
                subprocess.run(["true"], timeout=5)
            deadline = time.monotonic() + 7
            a.wait_peers(count=3)  # a count by keyword, not a bound
    """
    assert budget_of(source) == (3 * 10 + 100 + 4 * 5 + 7, DEFAULT_S)


def test_a_module_mark_applies_and_the_global_timeout_comes_from_pyproject() -> None:
    source = """
        import pytest
        pytestmark = [pytest.mark.swarm, pytest.mark.timeout(500)]

        def test_it(node):
            node.wait_exit(450)
    """
    assert budget_of(source) == (450, 500)
    assert global_timeout_s(REPO / "pyproject.toml") > 0
    assert covering() == SETUP_S


def test_a_bound_or_a_mark_not_made_of_constants_fails_by_name() -> None:
    source = """
        import pytest

        @pytest.mark.timeout(compute_it())
        def test_it(node, bound_s):
            node.wait_exit(bound_s)
    """
    (found,) = budgets(textwrap.dedent(source), DEFAULT_S)
    assert not found.covered and found.unknown == ("bound_s", "its timeout mark")
