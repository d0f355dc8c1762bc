"""What peers sent that this node refused: counted by reason and per peer, and reported as
merge results when it was an update (the node's event log and dashboard read them)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping

from merge.rejections import RejectionLog
from merge.result import MergeResult

logger = logging.getLogger(__name__)
DHT_WRITER = "dht-record"
"""Where refused DHT records are counted in the per-peer log (their writer is unknown)."""


class Rejections:
    """Counts what peers sent that this node refused (by reason, and per peer in `log`), and
    reports refused updates as merge results."""

    def __init__(
        self, on_merge: Callable[[MergeResult], None], log: RejectionLog | None = None
    ) -> None:
        self.counts: Counter[str] = Counter()
        self.log = log if log is not None else RejectionLog()
        self._on_merge = on_merge

    def __call__(
        self, reason: str, author: str, detail: str, *, seq: int | None = None, update: bool = True
    ) -> None:
        """`update=False` for what is not an update (heartbeats): no merge result for it."""
        self.counts[reason] += 1
        self.log.count(author, reason)
        logger.info("rejected %s from %s (seq %s): %s", reason, author, seq, detail)
        if update and reason != "bad_heartbeat":
            self._on_merge(MergeResult(False, author, seq or -1, 0, 0.0, reason))

    def count_many(self, reason: str, author: str, n: int, detail: str) -> None:
        """`n` refusals of one reason from one peer at once, in one log line (not an update's
        merge result): what a flood causes by the thousand is counted without a line each."""
        if n > 0:
            self.counts[reason] += n
            self.log.count(author, reason, n)
            logger.info("rejected %d x %s from %s: %s", n, reason, author, detail)

    def add_dht_refusals(self, counts: Mapping[str, int]) -> None:
        """Records the DHT process refused since the last call (dht.records.RefusalCounts),
        per reason. Who wrote a record is unknown to the DHT, so they are counted under the
        label DHT_WRITER, not a peer."""
        for reason, n in counts.items():
            if n > 0:
                self.counts[reason] += n
                self.log.count(DHT_WRITER, reason, n)
                logger.info("the DHT refused %d records: %s", n, reason)
