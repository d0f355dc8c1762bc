"""Opt-in: p2pd's own log lines in the node's log, to trace libp2p (hole punching, relays).

`DILOCO_P2PD_LOG` names go-log subsystems and their levels, in GOLOG_LOG_LEVEL's syntax (e.g.
`p2p-holepunch=debug,autorelay=info`); p2pd's lines of those then come out in the node's log
at INFO as `p2pd <caller>: <message>`. hivemind reads p2pd's output and logs it at DEBUG
(`hivemind.p2p.p2p_daemon`, INFO and WARNING lowered to DEBUG too), which the node does not
show otherwise. Unset (the default), nothing changes. A GOLOG_LOG_LEVEL already set wins.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

ENV = "DILOCO_P2PD_LOG"
P2PD_LOGGER = "hivemind.p2p.p2p_daemon"

logger = logging.getLogger(__name__)


class _Forward(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        logger.info("p2pd %s: %s", getattr(record, "caller", "?"), record.getMessage())


def forward_p2pd_log(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set p2pd's log levels from `DILOCO_P2PD_LOG` (before p2pd starts) and forward its
    lines into this module's logger, once per process; whether it is on."""
    spec = environ.get(ENV, "").strip()
    if not spec:
        return False
    environ.setdefault("GOLOG_LOG_LEVEL", f"error,{spec}")
    p2pd = logging.getLogger(P2PD_LOGGER)
    if not any(isinstance(h, _Forward) for h in p2pd.handlers):
        p2pd.setLevel(logging.DEBUG)
        p2pd.addHandler(_Forward())
    return True
