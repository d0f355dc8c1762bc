"""dht.realign's settings: when a replica realigns, how often, and what it compares (the
policy in dht.realign, its settle and gap in dht.realign_settle)."""

from __future__ import annotations

from dataclasses import dataclass

THRESHOLD = 0.02
"""Relative distance between settled points at one applied digest above which a replica
realigns (see dht.realign's doc: why 0.02)."""
SETTLE_TOLERANCE = 1e-6
"""Relative distance under which two settled points at one held digest are one (float
rounding): above it, a replica settles to the donor once the digest held long enough."""


@dataclass(frozen=True, kw_only=True)
class RealignConfig:
    period_s: float
    """The heartbeat period: the two sightings of a drift are at least this far apart."""
    threshold: float = THRESHOLD
    """Distance at a shared digest above which this node realigns to the donor, and within
    which one participant supports another."""
    cooldown_s: float = 60.0
    """Least time between two realignment attempts (successful or not)."""
    max_attempts: int = 3
    """Realignment attempts per `attempts_window_s`, whatever they gave."""
    attempts_window_s: float = 1800.0
    settle_tolerance: float = SETTLE_TOLERANCE
    """At a held digest, distance to the settle donor above which this node realigns."""
    settle_periods: float = 5.0
    """Periods this node's and the donor's sightings must hold together at one digest before
    a drift within the threshold is settled: a pause between bursts of updates is shorter,
    and each settle costs an attempt (the cap) and a state download."""
    max_settles: int = 3
    """Settle attempts per `attempts_window_s`, besides `max_attempts`."""
    settle_cooldown_periods: float = 5.0
    """Least time, in periods, between any attempt and a settle attempt."""
    settle_wave: int = 2
    """Replicas that settle at once: a donor serves two downloads at a time and refuses more
    (dht.state_transfer), and a refused attempt waits out the cooldown."""
    settle_stagger_periods: float = 3.0
    """Periods each further wave of settling replicas waits (the ones apart from the donor
    in peer id order, `settle_wave` a wave: every replica there ranks them alike)."""
    gap_periods: float = 3.0
    """Periods an update lost here and applied by a peer that does not hold it must have been
    named by summaries before this node downloads a peer's state for it (another summary
    may still name a holder, which revives it: dht.catchup)."""
    horizon_periods: float = 20.0
    """Sightings older than this many periods are forgotten."""
    max_digests_per_peer: int = 16
    """Sightings kept per participant (its latest digests)."""
    max_participants: int = 32
    """Participants compared (the heaviest records first, then by peer id): bounds the work
    of a period to O(max_participants^2 x max_digests_per_peer) sketch distances."""

    def __post_init__(self) -> None:
        for name in (
            "period_s", "threshold", "settle_tolerance", "settle_periods", "cooldown_s",
            "attempts_window_s", "settle_wave", "max_settles", "settle_cooldown_periods",
            "gap_periods",
        ):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}.")
        for name in ("max_attempts", "max_digests_per_peer", "max_participants"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}.")

    @property
    def horizon_s(self) -> float:
        return self.horizon_periods * self.period_s
