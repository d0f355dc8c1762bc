"""The `diloco-node` console script and `python -m node`.

Importing the CLI imports torch (seconds, tens of seconds on a loaded machine): Ctrl+C in
that time ends the command with the same one line as Ctrl+C later, not a traceback.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from node.cli import main as cli_main
    except KeyboardInterrupt:
        print("diloco-node: interrupted", file=sys.stderr)
        return 130
    return cli_main()
