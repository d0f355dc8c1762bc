"""Which wanted updates are fetched first, and how fast fresh authors' are (pure, clock passed in).

Under bench.attack's `zero_flood` the wanted updates were fetched in (author, seq) order: a
flooder whose key sorted first, announcing four valid updates a second, held the fetch slots,
and the honest peer's updates reached the other replica 5-9 s late (median; up to 98 s), in
bursts of 6-8. Now:

- wants of established authors (a track record in this replica: merge's `is_fresh_author` is
  false) come first, then fresh authors' wants; within each group authors take turns, each
  author's lowest seqs first, so one fresh key cannot starve another either;
- a fresh author starts at most `fresh_rate_per_s` fetches a second (`fresh_burst` at once),
  all fresh authors together at most `cohort_rate_per_s` (`cohort_burst`), and fresh authors'
  fetches hold at most `max_fresh_in_flight` of the fetch slots together: an established
  author's update always finds a slot within one fetch's time.

A fresh update passed over is *deferred*, never dropped: it stays wanted and is fetched when
its author's tokens allow, so every replica still applies the same set (later; the order an
update is applied in does not decide its verdict: dht.catchup, merge's ledger). Deferrals are
counted once per update (`fetch_deferred`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

UpdateId = tuple[str, int]


@dataclass(frozen=True, kw_only=True)
class FetchOrderConfig:
    fresh_rate_per_s: float = 1.0
    """Fetches a second one fresh author may start (an honest learner publishes one a round)."""
    fresh_burst: float = 4.0
    """Fetches one fresh author may start at once (a newcomer's first updates)."""
    cohort_rate_per_s: float = 2.0
    """Fetches a second all fresh authors together may start: minting keys buys no more."""
    cohort_burst: float = 8.0
    """Fetches all fresh authors together may start at once."""
    max_fresh_in_flight: int = 2
    """Fetch slots fresh authors' fetches may hold together (CatchUpConfig.max_in_flight has 4)."""

    def __post_init__(self) -> None:
        for name in ("fresh_rate_per_s", "cohort_rate_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}.")
        for name in ("fresh_burst", "cohort_burst"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}.")
        if self.max_fresh_in_flight < 1:
            raise ValueError(f"max_fresh_in_flight must be >= 1, got {self.max_fresh_in_flight!r}.")


class TokenBucket:
    """`rate_per_s` tokens a second, at most `burst` held; starts full."""

    def __init__(self, rate_per_s: float, burst: float, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = burst
        self._at = now

    def tokens(self, now: float) -> float:
        """Tokens held at `now` (a clock that steps back refills nothing)."""
        return min(self.burst, self._tokens + max(0.0, now - self._at) * self.rate_per_s)

    def take(self, now: float) -> None:
        """Spend one token (the caller checked `tokens(now) >= 1`)."""
        self._tokens = self.tokens(now) - 1.0
        self._at = max(self._at, now)

    def full(self, now: float) -> bool:
        return self.tokens(now) >= self.burst


class FetchOrder:
    """The order wanted updates are tried in, and whether a fresh author's fetch may start."""

    def __init__(self, config: FetchOrderConfig | None = None, *, now: float = 0.0) -> None:
        self.config = config or FetchOrderConfig()
        self._cohort = TokenBucket(self.config.cohort_rate_per_s, self.config.cohort_burst, now)
        self._authors: dict[str, TokenBucket] = {}
        """Fresh authors' buckets; a full one is forgotten (it holds nothing a new one lacks)."""

    def order(
        self,
        wanted: Iterable[UpdateId],
        is_fresh: Callable[[str], bool],
        *,
        with_fresh: bool = True,
    ) -> list[UpdateId]:
        """`wanted`, established authors' first, then (`with_fresh`) fresh authors'; within
        each, authors take turns (by name), each author's lowest seqs first."""
        seqs: dict[str, list[int]] = {}
        for author, seq in wanted:
            seqs.setdefault(author, []).append(seq)
        established = sorted(a for a in seqs if not is_fresh(a))
        fresh = sorted(a for a in seqs if is_fresh(a)) if with_fresh else []
        return _take_turns(established, seqs) + _take_turns(fresh, seqs)

    def may_admit(self, now: float, fresh_in_flight: int) -> bool:
        """Whether any fresh author's fetch could start now: when not, fresh wants need not
        even be ordered (the pump runs on every announcement: a backlog of thousands of a
        flood's wants, sorted each time, held the loop; bench.attack sybil_learners)."""
        return fresh_in_flight < self.config.max_fresh_in_flight and self._cohort.tokens(now) >= 1

    def admit(self, author: str, now: float, fresh_in_flight: int) -> bool:
        """Whether a fetch of fresh `author`'s update may start now, with `fresh_in_flight`
        fresh fetches running; a yes spends its tokens."""
        if fresh_in_flight >= self.config.max_fresh_in_flight:
            return False
        bucket = self._authors.get(author)
        if bucket is None:
            bucket = TokenBucket(self.config.fresh_rate_per_s, self.config.fresh_burst, now)
        if bucket.tokens(now) < 1 or self._cohort.tokens(now) < 1:
            return False
        bucket.take(now)
        self._cohort.take(now)
        self._authors[author] = bucket
        self._forget_full(now)
        return True

    def num_tracked(self) -> int:
        """Fresh authors with a bucket kept (bounded: full buckets are forgotten)."""
        return len(self._authors)

    def _forget_full(self, now: float) -> None:
        if len(self._authors) > 64:
            self._authors = {a: b for a, b in self._authors.items() if not b.full(now)}


def _take_turns(authors: list[str], seqs: dict[str, list[int]]) -> list[UpdateId]:
    """Each author's first (lowest) seq, in `authors`' order, then each one's second, ..."""
    turns = [
        (turn, rank, author, seq)
        for rank, author in enumerate(authors)
        for turn, seq in enumerate(sorted(seqs[author]))
    ]
    turns.sort()
    return [(author, seq) for _, _, author, seq in turns]
