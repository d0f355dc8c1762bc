"""Signals that stop a node: the first asks for a clean stop, a second Ctrl+C aborts; SIGUSR1
asks it to finish (end its rounds as at --max-rounds, then --linger and leave)."""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FINISH_SIGNAL = signal.SIGUSR1
"""Ends training after the current round, then lingers as at a limit (tests/swarm/test_attack
trains its honest nodes until the adversary is done, not for a guessed time)."""


@contextmanager
def stop_on_signals(
    request_stop: Callable[[], None], request_finish: Callable[[], None] | None = None
) -> Iterator[None]:
    """First SIGINT/SIGTERM/SIGHUP asks the node to stop cleanly (it saves its partial round);
    a second SIGINT aborts at once; SIGUSR1 calls `request_finish` (when given)."""

    def handle(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s, stopping after the current step", signal.Signals(signum).name)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        request_stop()

    def finish(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s, finishing after the current round", signal.Signals(signum).name)
        assert request_finish is not None
        request_finish()

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    if request_finish is not None:
        previous[FINISH_SIGNAL] = signal.signal(FINISH_SIGNAL, finish)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
