"""A node's uplink, measured from its own sends: bytes over the seconds it was busy sending.

dht.transport's send_blob reports each blob it sends (`begin` before its first byte, `end`
with the bytes that left). Sends that overlap (one update served to several peers at once)
share the link, so time is counted once while any send is in flight: a *busy period* runs
from the start of a send while none was in flight to the end of the last one in flight, and
its rate is the bytes of all its sends over its length. The uplink is the bytes of the last
`samples` busy periods over their seconds (no expiry by time, so a node whose sends became
small keeps the figure its large ones measured).

Periods under `min_bytes` are not counted: a small blob fits the local buffers (p2pd's
socket and the stream's flow-control window) and its send times those, not the link.

Pure: the clock is passed in; thread-safe (sends run on the swarm's event loop, the node reads
the figure on its training thread).
"""

from __future__ import annotations

import threading
from collections import deque

MIN_SAMPLE_BYTES = 256 << 10
"""Busy periods that moved less than this are not counted (they time local buffers)."""
SAMPLES = 32
"""Busy periods the uplink is measured over."""


class UplinkMeter:
    """Bytes over busy seconds of this process's sends (see the module docstring)."""

    def __init__(self, *, min_bytes: int = MIN_SAMPLE_BYTES, samples: int = SAMPLES) -> None:
        if min_bytes < 1 or samples < 1:
            raise ValueError("min_bytes and samples must be at least 1.")
        self.min_bytes = min_bytes
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self._bytes = 0
        self._periods: deque[tuple[int, float]] = deque(maxlen=samples)

    def begin(self, now: float) -> None:
        """A send starts at `now`."""
        with self._lock:
            if self._in_flight == 0:
                self._since, self._bytes = now, 0
            self._in_flight += 1

    def end(self, now: float, sent: int) -> None:
        """A send that `begin` announced ended at `now` having moved `sent` bytes (all of
        them, or what left before it failed)."""
        with self._lock:
            if self._in_flight == 0:  # an end without a begin: nothing to attribute it to
                return
            self._in_flight -= 1
            self._bytes += max(0, sent)
            if self._in_flight == 0:
                seconds = now - self._since
                if self._bytes >= self.min_bytes and seconds > 0:
                    self._periods.append((self._bytes, seconds))

    def bytes_per_s(self) -> float | None:
        """The measured uplink; None until a busy period of at least `min_bytes` ended."""
        with self._lock:
            seconds = sum(s for _, s in self._periods)
            if not self._periods or seconds <= 0:
                return None
            return sum(b for b, _ in self._periods) / seconds

    def samples(self) -> int:
        """Busy periods the figure is measured over."""
        with self._lock:
            return len(self._periods)
