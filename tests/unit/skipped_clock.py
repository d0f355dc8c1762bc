"""A wall clock a test can move forward: membership tests poll on the test's pacing, not by
sleeping, so a loaded machine (CI runs swarm tests beside the unit tests) changes no verdict.
CI 38 failed a test that polled every 25 ms against a 150 ms window."""

from __future__ import annotations


class SkippedClock:
    """time.time() as the wall clock at the test's start plus the seconds the test skipped
    (`skip`); the fixture `clock` (tests/unit/conftest.py) puts it in place for one test."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def skip(self, seconds: float) -> None:
        self.skipped += seconds
