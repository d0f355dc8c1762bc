"""Where the dashboard's figures come from: a node (embedded) or the DHT (standalone)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from dashboard.history import History
from dashboard.models import Mode, NodeOut
from dashboard.settings import DashboardSettings
from dashboard.view import SwarmState

logger = logging.getLogger(__name__)

STALE_AFTER_POLLS = 5
"""/healthz reports stale when the swarm has not been read for this many poll periods."""


class DataSource(Protocol):
    mode: Mode
    history: History

    def state(self) -> SwarmState:
        """The latest reading of the swarm."""
        ...

    def node(self) -> NodeOut | None:
        """The local node, embedded only; None when standalone."""
        ...

    def data_age_s(self) -> float | None:
        """Seconds since the swarm was last read successfully; None before the first read."""
        ...


class PolledSource:
    """Reads the swarm every poll period in a background thread; each reading is sampled."""

    mode: Mode

    def __init__(self, run_id: str, settings: DashboardSettings, history: History) -> None:
        self.run_id = run_id
        self.settings = settings
        self.history = history
        self._state: SwarmState | None = None
        self._read_at = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> SwarmState:
        """One reading of the swarm; implemented by each source."""
        raise NotImplementedError

    def refresh(self) -> SwarmState | None:
        try:
            state = self.read()
        except Exception as exc:  # the network or a racing writer: keep the last reading
            logger.warning("reading the swarm failed: %s", exc)
            return None
        with self._lock:
            self._state, self._read_at = state, time.monotonic()
        self.history.sample(state)
        return state

    def state(self) -> SwarmState:
        with self._lock:
            state = self._state
        if state is None:
            state = self.refresh() or self._empty()
        return state

    def data_age_s(self) -> float | None:
        with self._lock:
            return time.monotonic() - self._read_at if self._state is not None else None

    def node(self) -> NodeOut | None:
        return None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dashboard-poll", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self.settings.poll_period_s)

    def _empty(self) -> SwarmState:
        return SwarmState(self.run_id, "", self.mode, [], time.time())
