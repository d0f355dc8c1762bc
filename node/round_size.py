"""Dynamic local updates: a round's inner steps follow this learner's measured throughput.

After Liu et al. (arXiv 2401.09135): the fastest live learner runs H inner steps per round and a
slower one proportionally fewer, so every learner's round lasts about as long and none of them
publishes far staler updates than the others. The step count of learner i is

    H_i = clamp(round(H * r_i / r_ref), H_min, H)

with r_i its own inner steps per second (an exponential moving average over its rounds, its
emulated slow-down included) and r_ref the fastest credible rate among itself and its live
peers, each of which reports its own rate in its signed heartbeat.

A heartbeat is the peer's word, so a peer's rate counts only as far as the signed updates this
node merged from it bear it out (robust to a peer claiming absurd throughput):
- a peer's claim is credited up to ``slack`` times the inner steps per second its last updates
  delivered (their signed step counts over the local time they took to arrive), so a peer that
  claims to be fast must publish updates that carry the steps to show it; a peer with fewer
  than two updates merged here is not counted yet;
- no claim is credited beyond ``1 / min_fraction`` times this learner's own rate, so the worst a
  liar achieves is the floor H_min = max(1, ceil(H * min_fraction)), never a round of one step
  (for H >= 1 / min_fraction).
Until it has measured itself, a learner runs H steps.

The class is pure over what it is told (no clock, no I/O): equal observations give equal step
counts, which unit and property tests pin down. It is thread-safe: merges report peers' updates
from the swarm's thread while the training thread sizes rounds.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RoundSizeConfig:
    """How round lengths follow throughput."""

    max_steps: int
    """H: the inner steps of the fastest learner's round."""
    min_fraction: float = 1 / 16
    """The slowest learner still runs at least this share of H (and at least one step)."""
    smoothing: float = 0.5
    """Weight of the newest round in the moving average of this learner's rate, in (0, 1]."""
    slack: float = 4.0
    """A peer's claimed rate is credited up to this many times the rate its updates delivered
    (rounds spend time outside inner steps: evaluation, encoding, merging)."""
    window: int = 8
    """Updates per peer over which its delivered rate is measured."""

    def __post_init__(self) -> None:
        if type(self.max_steps) is not int or self.max_steps < 1:
            raise ValueError(f"max_steps must be an integer >= 1, got {self.max_steps!r}.")
        if not 0 < self.min_fraction <= 1:
            raise ValueError(f"min_fraction must be in (0, 1], got {self.min_fraction!r}.")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing!r}.")
        if not (math.isfinite(self.slack) and self.slack >= 1):
            raise ValueError(f"slack must be a finite number >= 1, got {self.slack!r}.")
        if type(self.window) is not int or self.window < 2:
            raise ValueError(f"window must be an integer >= 2, got {self.window!r}.")

    @property
    def min_steps(self) -> int:
        """H_min: the fewest inner steps a round is sized to."""
        return max(1, math.ceil(self.max_steps * self.min_fraction - 1e-9))


@dataclass(frozen=True)
class PeerRate:
    """A live peer's rate as its heartbeat claims it (inner steps per second; 0: unknown)."""

    peer_id: str
    steps_per_s: float


class RoundSizer:
    """Decides how many inner steps this learner's next round runs."""

    def __init__(self, config: RoundSizeConfig) -> None:
        self.config = config
        self._own: float | None = None
        self._arrivals: dict[str, deque[tuple[float, float]]] = {}
        self._lock = threading.Lock()

    @property
    def own_rate(self) -> float | None:
        """This learner's inner steps per second (moving average), None before any round."""
        return self._own

    def observe_round(self, num_steps: int, compute_s: float) -> None:
        """A round of this learner: ``num_steps`` inner steps in ``compute_s`` seconds."""
        if num_steps <= 0 or not (math.isfinite(compute_s) and compute_s > 0):
            return
        rate = num_steps / compute_s
        a = self.config.smoothing
        with self._lock:
            self._own = rate if self._own is None else a * rate + (1 - a) * self._own

    def observe_update(self, author: str, num_steps: float, at_s: float) -> None:
        """An update of ``author`` merged here at local time ``at_s`` (signed step count)."""
        if num_steps < 0 or not math.isfinite(at_s):
            return
        with self._lock:
            arrivals = self._arrivals.setdefault(author, deque(maxlen=self.config.window))
            arrivals.append((at_s, num_steps))

    def forget(self, author: str) -> None:
        """Drop what was measured of a peer (it left)."""
        with self._lock:
            self._arrivals.pop(author, None)

    def delivered_rate(self, author: str) -> float | None:
        """Inner steps per second ``author``'s last updates carried; None with too few."""
        with self._lock:
            arrivals = list(self._arrivals.get(author, ()))
        if len(arrivals) < 2:
            return None
        span = arrivals[-1][0] - arrivals[0][0]
        if span <= 0:
            return math.inf  # a burst (catch-up): it bounds nothing
        return sum(steps for _, steps in arrivals[1:]) / span

    def credible_rate(self, peer: PeerRate) -> float:
        """What of a peer's claim this node believes (0: nothing)."""
        return self._credible(peer, self._own)

    def reference_rate(self, peers: Iterable[PeerRate]) -> float | None:
        """The fastest credible rate of this learner and its live peers."""
        own = self._own
        return None if own is None else self._reference(peers, own)

    def steps(self, peers: Iterable[PeerRate]) -> int:
        """Inner steps of the next round, in [H_min, H]: H until this learner measured itself."""
        own, c = self._own, self.config
        if own is None:
            return c.max_steps
        scaled = round(c.max_steps * own / self._reference(peers, own))
        return min(c.max_steps, max(c.min_steps, scaled))

    def _reference(self, peers: Iterable[PeerRate], own: float) -> float:
        return max([own, *(self._credible(p, own) for p in peers)])

    def _credible(self, peer: PeerRate, own: float | None) -> float:
        claim = peer.steps_per_s
        delivered = self.delivered_rate(peer.peer_id)
        if own is None or delivered is None or not (math.isfinite(claim) and claim > 0):
            return 0.0
        return min(claim, self.config.slack * delivered, own / self.config.min_fraction)
