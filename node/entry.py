"""The `diloco-node` console script and `python -m node`.

Importing the CLI imports torch (seconds, tens of seconds on a loaded machine): Ctrl+C in
that time ends the command with the same one line as Ctrl+C later, not a traceback, once the
imports are done. The first Ctrl+C is only remembered there: a KeyboardInterrupt raised inside
an import can be swallowed (a library's bare `except:`; importlib's module-lock weakref
callback prints and ignores it, and the node then trained on) or abort the interpreter inside
torch's C initialisation (seen once in ~150 Ctrl+C's at random times of the start). A second
Ctrl+C raises at once.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType


def main() -> int:
    interrupted: list[int] = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        interrupted.append(signum)
        if len(interrupted) > 1:
            raise KeyboardInterrupt

    # Until the CLI is imported; then Python's own handler until the node installs its own
    # (node.signals: a clean stop after the current step).
    signal.signal(signal.SIGINT, interrupt)
    try:
        from node.cli import main as cli_main

        signal.signal(signal.SIGINT, signal.default_int_handler)
        if interrupted:
            raise KeyboardInterrupt
        return cli_main()
    except KeyboardInterrupt:
        print("diloco-node: interrupted", file=sys.stderr)
        return 130
