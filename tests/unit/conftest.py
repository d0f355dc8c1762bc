from __future__ import annotations

import time

import pytest

from tests.unit.skipped_clock import SkippedClock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SkippedClock:
    """time.time() for this test: the wall clock at its start, moved only by what the test
    skips. Real time does not leak in: CI 43 (stop 43) failed a 50 ms-period test whose poll
    ran past three periods of real time on a loaded worker."""
    skipped = SkippedClock()
    start = time.time()
    monkeypatch.setattr(time, "time", lambda: start + skipped.skipped)
    return skipped
