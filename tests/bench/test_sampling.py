"""The benches' background sampler: samples while inside `with`, none after; RSS and open
files of the gone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from bench.sampling import BackgroundSampler, open_files, rss_bytes


class Counter(BackgroundSampler):
    def __init__(self) -> None:
        super().__init__(period_s=0.005)
        self.count = 0
        self.enough = threading.Event()
        self.closed = False

    def sample(self) -> None:
        self.count += 1
        if self.count >= 3:
            self.enough.set()

    def close(self) -> None:
        self.closed = True


def test_it_samples_every_period_inside_with_and_stops_at_exit() -> None:
    with Counter() as counter:
        assert counter.enough.wait(10), "three samples of 5 ms did not come in 10 s"
    after_exit = counter.count
    threading.Event().wait(0.05)  # ten periods: a thread left running would sample again

    assert counter.closed and counter.count == after_exit >= 3


def test_rss_of_a_live_process_and_of_one_that_is_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)

    assert (rss_bytes(os.getpid()) or 0) > 1 << 20
    assert rss_bytes(child.pid) is None


def test_open_files_of_a_live_process_and_of_one_that_is_gone(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    before = open_files(os.getpid())
    with (tmp_path / "held").open("w"):
        held = open_files(os.getpid())

    assert before is not None and held == before + 1
    assert open_files(child.pid) is None


def test_a_period_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        BackgroundSampler(period_s=0)
