from __future__ import annotations

import time

import pytest

from tests.unit.skipped_clock import SkippedClock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SkippedClock:
    """time.time() for this test: the wall clock plus what the test skips."""
    skipped = SkippedClock()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + skipped.skipped)
    return skipped
