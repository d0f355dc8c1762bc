"""When to dial the bootstrap again, and whom: a pure policy over a clock passed in.

A node that starts while its bootstrap is busy (sixteen nodes starting at once on two cores)
or briefly absent (restarting) should wait and try again rather than exit; a node whose
bootstrap is gone for good should still reach the swarm through the peers it knew last run
(dht/known_peers.py). The policy decides; dht/preflight.py probes and sleeps.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

MIN_WAIT_S = 0.01
"""A wait shorter than this is not worth another attempt: the bound counts as spent."""
MAX_KNOWN_TRIED = 8
"""Known peers tried per attempt besides the bootstrap peers, most recently seen first."""


@dataclass(frozen=True, kw_only=True)
class RetryBounds:
    """How long a node keeps trying to reach its first peer before it gives up."""

    first_delay_s: float = 1.0
    """Wait after the first failed attempt; each further wait doubles it."""
    max_delay_s: float = 15.0
    """The longest single wait between two attempts."""
    give_up_after_s: float = 90.0
    """No attempt starts later than this after the first one."""

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("retry delays need 0 < first_delay_s <= max_delay_s")
        if self.give_up_after_s < 0:
            raise ValueError("give_up_after_s must be >= 0")


def candidates(
    bootstrap: Sequence[str], known: Iterable[str], max_known: int = MAX_KNOWN_TRIED
) -> list[str]:
    """Addresses to try, each once: the bootstrap peers as given, then up to `max_known`
    peers known from last run (in their order: most recently seen first)."""
    chosen = list(dict.fromkeys(bootstrap))
    extra = [m for m in dict.fromkeys(known) if m not in chosen]
    return chosen + extra[:max_known]


class BootstrapRetry:
    """Counts failed attempts to reach any candidate; says how long to wait before the next,
    or that the bound is spent. Exponential backoff, capped; the last wait is cut so that no
    attempt starts after `give_up_after_s`."""

    def __init__(self, bounds: RetryBounds, clock: Callable[[], float]) -> None:
        self.bounds = bounds
        self._clock = clock
        self._started_at = clock()
        self.num_failed = 0

    @property
    def elapsed_s(self) -> float:
        return self._clock() - self._started_at

    def next_delay_s(self) -> float:
        """The uncut wait after the current number of failures."""
        exponent = min(max(self.num_failed - 1, 0), 62)
        return float(min(self.bounds.max_delay_s, self.bounds.first_delay_s * 2.0**exponent))

    def failed(self) -> float | None:
        """Record a failed attempt; seconds to wait before the next one, None to give up."""
        self.num_failed += 1
        remaining = self.bounds.give_up_after_s - self.elapsed_s
        if remaining < MIN_WAIT_S:
            return None
        return min(self.next_delay_s(), remaining)


@dataclass(frozen=True, kw_only=True)
class RejoinBounds:
    """How a known member that found no peer at start dials its known peers again, in the
    background while it trains: capped exponential backoff, never giving up.

    The cap is short because p2pd spaces the real dials itself: go-libp2p's swarm refuses a
    dial to an address for 5 s + k^2 s after its k-th failure in a row (`dial backoff`, at
    once, no packet sent) until a connection to that peer clears it. A peer down for 25 s
    is dialled again 9-10 s after it is back with dials every 1-2 s (bench.dial_backoff,
    session 15); the 15 s cap this had put up to 15 s more on top: in bench.chaos
    --topology nat the symmetric home reached the restarted public node 29 s after it
    listened, and 12 updates it trained alone meanwhile were lost at its next kill."""

    first_delay_s: float = 1.0
    max_delay_s: float = 3.0

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("rejoin delays need 0 < first_delay_s <= max_delay_s")


class RejoinBackoff:
    """When the next background dial is due. `alone(now)` says whether to dial now; a dial
    that reached nobody (`failed`) doubles the wait, up to the cap; being connected
    (`connected`) resets it, so that losing every peer later starts again from the first
    delay. Pure: the clock is passed in."""

    def __init__(self, bounds: RejoinBounds, now: float) -> None:
        self.bounds = bounds
        self.num_failed = 0
        self._due_at = now  # the first dial at once

    def delay_s(self) -> float:
        """The wait after the current number of consecutive failed dials."""
        exponent = min(max(self.num_failed - 1, 0), 62)
        return float(min(self.bounds.max_delay_s, self.bounds.first_delay_s * 2.0**exponent))

    def alone(self, now: float) -> bool:
        """Connected to nobody at `now`: whether a dial is due."""
        return now >= self._due_at

    def failed(self, now: float) -> float:
        """A dial at `now` reached nobody; seconds until the next one."""
        self.num_failed += 1
        wait_s = self.delay_s()
        self._due_at = now + wait_s
        return wait_s

    def reached(self, now: float) -> float:
        """A dial at `now` reached a peer: the count starts over, and the next dial (should that
        connection close at once) waits the first delay; that delay."""
        self.num_failed = 0
        self._due_at = now + self.bounds.first_delay_s
        return self.bounds.first_delay_s

    def connected(self, now: float) -> None:
        """Some peer is connected at `now`: a later loss dials at once, from the first delay."""
        self.num_failed = 0
        self._due_at = now
