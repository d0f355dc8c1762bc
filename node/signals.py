"""Signals that stop a node: the first asks for a clean stop, a second Ctrl+C aborts."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def stop_on_signals(request_stop: Callable[[], None]) -> Iterator[None]:
    """First SIGINT/SIGTERM/SIGHUP asks the node to stop cleanly (it saves its partial round);
    a second SIGINT aborts at once."""

    def handle(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s, stopping after the current step", signal.Signals(signum).name)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        request_stop()

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
