"""Which codec a node on a thin link publishes with: chosen from its measured uplink.

A round's upload is what the node serves of its own update: under gossip each of the other
M - 1 learners fetches it once (bench.wire's model of the wire), so one round costs
(M - 1) x the update's payload. The node takes the codec with the most bytes (the least
lossy) whose round upload fits in a share of the round's time, so the upload keeps up with
training and leaves the rest of the link to state transfers, repair and heartbeats; when none
fits it takes the smallest and says that its link cannot keep up.

Mixed codecs: every update's signed header names its codec and every replica decodes each
update by that name before it weighs and applies it, so replicas apply the same numbers
whichever codec each author chose; the codec is not part of the run fingerprint, and nodes
of one swarm may each pick their own. (The outer optimizer is part of the fingerprint: a
picked codec never changes it, see merge.feedback.default_outer_momentum.)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from merge.codec_names import AUTO as AUTO  # re-exported: callers name it here
from merge.codecs import get_codec

AUTO_CODECS = ("bf16", "int8", "int4", "topk")
"""What `--codec auto` chooses among (fp32 doubles bf16's bytes for no measured gain)."""
DEFAULT_UPLINK_SHARE = 0.5
"""Share of a round's time the round's upload may take."""


@dataclass(frozen=True)
class CodecChoice:
    """The chosen codec and the figures it was chosen by."""

    codec: str
    upload_s: float
    """Seconds the round's upload takes at the measured uplink with this codec."""
    budget_s: float
    """Seconds the round's upload may take."""

    @property
    def fits(self) -> bool:
        return self.upload_s <= self.budget_s

    def describe(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit (the link cannot keep up)"
        return (
            f"codec {self.codec}: a round's upload takes {self.upload_s:.1f} s of the "
            f"{self.budget_s:.1f} s allowed, {verdict}"
        )


def round_upload_bytes(codec: str, numel: int, learners: int) -> int:
    """Bytes a node serves of one round's update: one copy to each other learner."""
    return max(1, learners - 1) * get_codec(codec).payload_bytes(numel)


def pick_codec(
    *,
    numel: int,
    uplink_bytes_per_s: float,
    round_s: float,
    learners: int,
    share: float = DEFAULT_UPLINK_SHARE,
    candidates: Iterable[str] = AUTO_CODECS,
) -> CodecChoice:
    """The least lossy of ``candidates`` whose round upload fits ``share`` of ``round_s``
    at ``uplink_bytes_per_s``; the smallest of them when none fits."""
    if not (math.isfinite(uplink_bytes_per_s) and uplink_bytes_per_s > 0):
        raise ValueError(f"uplink must be a positive rate, got {uplink_bytes_per_s!r} B/s.")
    if not (math.isfinite(round_s) and round_s > 0) or not 0 < share <= 1:
        raise ValueError("round time must be positive and the upload share in (0, 1].")
    if numel < 1 or learners < 1:
        raise ValueError("numel and learners must be at least 1.")
    budget_s = share * round_s
    choices = sorted(
        (
            CodecChoice(
                name, round_upload_bytes(name, numel, learners) / uplink_bytes_per_s, budget_s
            )
            for name in candidates
        ),
        key=lambda choice: -choice.upload_s,
    )
    if not choices:
        raise ValueError("no codec to choose from.")
    return next((choice for choice in choices if choice.fits), choices[-1])


START_CODEC = "bf16"
"""What `--codec auto` sends before its uplink and round time are measured: the least lossy
candidate, whose large sends measure the link (a small payload would time local buffers)."""
UPGRADE_SHARE = 0.5
"""A less lossy codec is taken only when it fits this share of the budget (hysteresis: a
measured uplink that wavers about a threshold does not switch the codec every round)."""


def start_codec(codec: str) -> str:
    """The codec a node starts sending with: `codec` itself, or START_CODEC for auto."""
    return START_CODEC if codec == AUTO else codec


class CodecPicker:
    """`--codec auto`: at each round start, the codec for this round from the uplink measured
    so far and the time since the last round start (pick_codec), moving to a less lossy codec
    only when it fits UPGRADE_SHARE of the budget, so the choice does not flap; to a lossier
    one as soon as the current one does not fit. Before both figures are in: START_CODEC."""

    def __init__(
        self,
        numel: int,
        *,
        share: float = DEFAULT_UPLINK_SHARE,
        candidates: Iterable[str] = AUTO_CODECS,
    ) -> None:
        self.numel, self.share, self.candidates = numel, share, tuple(candidates)
        self.codec = START_CODEC if START_CODEC in self.candidates else self.candidates[0]
        self._last_start: float | None = None

    def round_start(
        self, now: float, uplink_bytes_per_s: float | None, learners: int
    ) -> CodecChoice | None:
        """The codec for the round starting at `now` (None: not measured yet, keep `codec`)."""
        last, self._last_start = self._last_start, now
        if last is None or now <= last or uplink_bytes_per_s is None:
            return None
        if not (math.isfinite(uplink_bytes_per_s) and uplink_bytes_per_s > 0):
            return None
        round_s = now - last

        def pick(share: float) -> CodecChoice:
            return pick_codec(
                numel=self.numel,
                uplink_bytes_per_s=uplink_bytes_per_s,
                round_s=round_s,
                learners=learners,
                share=share,
                candidates=self.candidates,
            )

        current = _bytes(self.codec, self.numel)
        choice = pick(self.share)
        if current < _bytes(choice.codec, self.numel):  # less lossy: only with room to spare
            strict = pick(self.share * UPGRADE_SHARE)
            upgrade = strict.fits and current < _bytes(strict.codec, self.numel)
            choice = (
                CodecChoice(strict.codec, strict.upload_s, choice.budget_s)
                if upgrade
                else self._current(choice, learners, uplink_bytes_per_s)
            )
        self.codec = choice.codec
        return choice

    def _current(self, choice: CodecChoice, learners: int, uplink: float) -> CodecChoice:
        upload_s = round_upload_bytes(self.codec, self.numel, learners) / uplink
        return CodecChoice(self.codec, upload_s, choice.budget_s)


def _bytes(codec: str, numel: int) -> int:
    return get_codec(codec).payload_bytes(numel)
