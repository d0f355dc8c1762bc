"""What became of one submitted update: the record the merge pipeline returns and the swarm
reports for the updates it refuses before they reach the pipeline (dht.rejections)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MergeResult:
    """What became of one submitted update."""

    accepted: bool
    author: str
    seq: int
    staleness: int
    weight: float
    reason: str | None
    learners: int = 1
    """The learner count the update was sized by (one round of that many makes a step)."""
    blocks_corrected: int = 0
    """Blocks of the update that the staleness correction changed."""
    robust: str | None = None
    """A robust verdict (merge.robust.REASONS) that clipped or zeroed the update's contribution;
    its id is applied all the same, so replicas keep one applied set."""
    inner_steps: int = 0
    """Inner steps behind the update, as its signed header says (0 for a rejected one)."""
