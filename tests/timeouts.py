"""The one place for the bounds of real-process tests' waits (tests/swarm, tests/node).

Each wait is bounded by a named constant, and a test that can wait longer than pytest's
global timeout (pyproject's ``timeout``) carries ``@pytest.mark.timeout(covering(...))``
computed from the same constants, so pytest-timeout never kills a test before the wait that
hung has said which one it was. tests/unit/test_wait_budget.py checks every test against the
waits it makes (tests/wait_budget.py reads them from the source).

The figures are generous for a loaded 2-core CI machine: a bound is only reached when
something hangs, so a large one costs nothing in a passing run.
"""

from __future__ import annotations

START_S = 120
"""A node process starting: imports, DHT, listening, its first round."""
MERGE_S = 90
"""A peer's update published, fetched and merged (or an event of the next round)."""
SLOW_MERGE_S = 120
"""The same for a node that trains slower than its peers (--speed-factor)."""
EXIT_S = 45
"""A node asked to stop (SIGINT, --max-rounds reached) saving its checkpoint and exiting."""
ONE_ROUND_RUN_S = 120
"""A whole `join --max-rounds 1` run of the tiny model in one process, start to exit."""
CLI_ERROR_S = 60
"""A CLI command that refuses its input: imports, then one line on stderr."""
SETUP_S = 30
"""What a test spends outside its waits: fixtures, launching processes, reaping them."""


def covering(*waits_s: float) -> float:
    """A test's timeout: the sum of the waits it can make one after another, plus SETUP_S."""
    return sum(waits_s) + SETUP_S
