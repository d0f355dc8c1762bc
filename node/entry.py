"""The `diloco-node` console script and `python -m node`.

Importing what a command needs can take seconds (torch, when join starts; tens of seconds on a
loaded machine): Ctrl+C in that time ends the command with the same one line as Ctrl+C later,
not a traceback, once the imports are done. The first Ctrl+C is only remembered there: a
KeyboardInterrupt raised inside an import can be swallowed (a library's bare `except:`;
importlib's module-lock weakref callback prints and ignores it, and the node then trained on)
or abort the interpreter inside torch's C initialisation (seen once in ~150 Ctrl+C's at random
times of the start). A second Ctrl+C raises at once. The CLI's own imports load no torch
(`--help` answers in about a second); `join` imports the node under `interrupts_deferred`.
"""

from __future__ import annotations

import sys

from node.interrupts import interrupts_deferred as interrupts_deferred


def main() -> int:
    try:
        with interrupts_deferred():
            from node.cli import main as cli_main
        return cli_main()
    except KeyboardInterrupt:
        print("diloco-node: interrupted", file=sys.stderr)
        return 130
