"""Ctrl+C while a command imports what it needs (torch: seconds, tens of seconds loaded):
remembered, raised once the imports are done (node/entry.py says why). Its own module so that
the entry point and the CLI share it without importing each other."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """The first Ctrl+C inside is remembered and raised as KeyboardInterrupt on leaving (a
    second raises at once); then Python's own handler, until the node installs its own
    (node.signals: a clean stop after the current step)."""
    interrupted: list[int] = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        interrupted.append(signum)
        if len(interrupted) > 1:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if interrupted:
        raise KeyboardInterrupt
