"""How far a long download is: bytes, rate and time left, for the console and the dashboard.

A state download over a thin or relayed link takes minutes and many streams (dht.resumable);
a user should see it move. The rate is measured over the last WINDOW_S seconds, not since the
start, so a stall shows at once as a falling rate and a growing ETA, and an early burst (a
direct path that later became relayed) stops flattering the estimate after a window.
Pure: the caller passes the clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW_S = 10.0
"""The rate is the bytes of the last this many seconds over their duration."""
SAMPLE_S = 0.1
"""Samples closer together than this are merged (one per 64 KiB chunk would be many)."""
MIN_RATE_SPAN_S = 0.5
"""No rate (and no ETA) before this much time has been measured."""
REPORT_EVERY_S = 5.0
"""Progress is told at most this often, the first time after this long: a short download
tells nothing but its end."""


@dataclass(frozen=True, kw_only=True)
class ProgressReport:
    peer_id: str
    num_bytes: int
    total_bytes: int | None
    """What the donor announced (None before its first answer)."""
    bytes_per_s: float | None
    eta_s: float | None
    elapsed_s: float

    @property
    def fraction(self) -> float | None:
        if not self.total_bytes:
            return None
        return self.num_bytes / self.total_bytes

    def line(self) -> str:
        """`12.3 of 50.0 MB (25 %), 1.2 MB/s, 31 s left`."""
        done = f"{self.num_bytes / 1e6:.1f}"
        if self.total_bytes:
            done += f" of {self.total_bytes / 1e6:.1f} MB ({100 * (self.fraction or 0):.0f} %)"
        else:
            done += " MB"
        rate = f", {self.bytes_per_s / 1e6:.2f} MB/s" if self.bytes_per_s is not None else ""
        eta = f", {format_eta(self.eta_s)} left" if self.eta_s is not None else ""
        return done + rate + eta


def format_eta(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"


class TransferProgress:
    """One download from one peer, however many streams it takes."""

    def __init__(self, peer_id: str, started_at: float) -> None:
        self.peer_id = peer_id
        self.started_at = started_at
        self.num_bytes = 0
        self.total_bytes: int | None = None
        self._samples: deque[tuple[float, int]] = deque([(started_at, 0)])
        self._told_at = started_at

    def update(self, num_bytes: int, total_bytes: int | None, now: float) -> None:
        """The bytes received so far (they only grow) and the announced total."""
        self.num_bytes = max(self.num_bytes, num_bytes)
        self.total_bytes = total_bytes if total_bytes is not None else self.total_bytes
        if now - self._samples[-1][0] < SAMPLE_S and len(self._samples) > 1:
            self._samples[-1] = (self._samples[-1][0], self.num_bytes)
        else:
            self._samples.append((now, self.num_bytes))
        # keep one sample at or before the window's start: the rate spans the whole window
        while len(self._samples) > 2 and self._samples[1][0] <= now - WINDOW_S:
            self._samples.popleft()

    def bytes_per_s(self, now: float) -> float | None:
        since, then = self._samples[0]
        for at, num_bytes in self._samples:  # the last sample at or before the window's start
            if at > now - WINDOW_S:
                break
            since, then = at, num_bytes
        span = now - since
        if span < MIN_RATE_SPAN_S:
            return None
        return (self.num_bytes - then) / span

    def report(self, now: float) -> ProgressReport:
        rate = self.bytes_per_s(now)
        eta = None
        if rate is not None and rate > 0 and self.total_bytes is not None:
            eta = max(0, self.total_bytes - self.num_bytes) / rate
        return ProgressReport(
            peer_id=self.peer_id,
            num_bytes=self.num_bytes,
            total_bytes=self.total_bytes,
            bytes_per_s=rate,
            eta_s=eta,
            elapsed_s=now - self.started_at,
        )

    def due(self, now: float) -> bool:
        """Whether to tell the progress now (then not again for REPORT_EVERY_S)."""
        if now - self._told_at < REPORT_EVERY_S:
            return False
        self._told_at = now
        return True
