"""A long download's bytes, rate and ETA (pure: the test passes the clock)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dht.transfer_progress import REPORT_EVERY_S, WINDOW_S, TransferProgress, format_eta

MB = 1_000_000


def feed(progress: TransferProgress, rate: float, seconds: float, start: float, total: int) -> int:
    """Bytes at `rate` per second for `seconds`, one update every 0.25 s; the bytes so far."""
    num_bytes = progress.num_bytes
    for i in range(1, int(seconds * 4) + 1):
        num_bytes = min(total, progress.num_bytes + int(rate / 4))
        progress.update(num_bytes, total, start + i / 4)
    return num_bytes


def test_a_steady_download_reports_its_rate_and_the_time_left() -> None:
    progress = TransferProgress("donor", 0.0)
    feed(progress, 1 * MB, 20.0, 0.0, 100 * MB)
    report = progress.report(20.0)
    assert report.num_bytes == 20 * MB and report.fraction == pytest.approx(0.2)
    assert report.bytes_per_s == pytest.approx(1 * MB, rel=0.01)
    assert report.eta_s == pytest.approx(80.0, rel=0.01)
    assert report.line() == "20.0 of 100.0 MB (20 %), 1.00 MB/s, 1 min 20 s left"


def test_the_rate_follows_the_link_not_the_average_since_the_start() -> None:
    progress = TransferProgress("donor", 0.0)
    feed(progress, 10 * MB, 10.0, 0.0, 1000 * MB)  # direct at first
    feed(progress, 0.1 * MB, 2 * WINDOW_S, 10.0, 1000 * MB)  # then relayed
    rate = progress.report(10.0 + 2 * WINDOW_S).bytes_per_s
    assert rate == pytest.approx(0.1 * MB, rel=0.05)


def test_a_stall_shows_as_a_falling_rate_and_a_growing_eta() -> None:
    progress = TransferProgress("donor", 0.0)
    feed(progress, 1 * MB, 10.0, 0.0, 100 * MB)
    before, stalled = progress.report(10.0), progress.report(10.0 + WINDOW_S)
    assert stalled.bytes_per_s == 0.0 and stalled.eta_s is None
    assert before.eta_s is not None and before.bytes_per_s == pytest.approx(1 * MB, rel=0.01)


def test_nothing_is_estimated_before_half_a_second_or_before_the_total_is_known() -> None:
    progress = TransferProgress("donor", 0.0)
    progress.update(1000, None, 0.2)
    early = progress.report(0.2)
    assert early.bytes_per_s is None and early.eta_s is None and early.fraction is None
    assert progress.report(1.0).eta_s is None  # a rate, but no total yet
    assert early.line() == "0.0 MB"


def test_progress_is_told_every_few_seconds_never_at_the_start() -> None:
    progress = TransferProgress("donor", 100.0)
    told = [t for t in range(100, 121) if progress.due(float(t))]
    assert told == [100 + REPORT_EVERY_S, 100 + 2 * REPORT_EVERY_S, 100 + 3 * REPORT_EVERY_S, 120]


@pytest.mark.parametrize(
    ("seconds", "text"), [(5.4, "5 s"), (61.0, "1 min 1 s"), (7322.0, "2 h 2 min")]
)
def test_eta_reads_in_the_largest_units(seconds: float, text: str) -> None:
    assert format_eta(seconds) == text


@given(
    st.lists(st.tuples(st.floats(0.0, 5.0), st.integers(0, 10 * MB)), min_size=1, max_size=60),
    st.integers(1, 1000 * MB),
)
def test_a_report_is_never_negative_nor_past_the_total(
    steps: list[tuple[float, int]], total: int
) -> None:
    progress = TransferProgress("donor", 0.0)
    now, num_bytes = 0.0, 0
    for gap_s, more in steps:
        now += gap_s
        num_bytes = min(total, num_bytes + more)
        progress.update(num_bytes, total, now)
        report = progress.report(now)
        assert report.num_bytes == num_bytes
        assert report.bytes_per_s is None or report.bytes_per_s >= 0
        assert report.eta_s is None or report.eta_s >= 0
        assert 0 <= (report.fraction or 0) <= 1
    assert len(progress._samples) <= 2 + WINDOW_S / 0.1 + 1
