"""Whether, from whom and for how long a joining node downloads a state, and why it did not.

A join (or restart) download used to be one look at the live peers: none ahead, or every donor
failing a few passes in a row, and `StateTransfer.download` returned None with no event. On a
loaded machine that look came too early (session 22: a public newcomer behind a relay whose
donors' dials failed for a few seconds caught up by gossip instead, its log full of
`update_needs_state`), and nobody could see why. Here the decision is made pass after pass:

- live donors ahead (serving state, more applied than this replica) are tried, best first
  (dht.state_check.rank_donors); a donor that sent a state to refuse is not tried again, one
  that was busy or out of reach is, every pass, until `patience_s` after the first look;
- no live peer yet, though bootstrap peers were given: wait for a first heartbeat for two
  periods and two seconds (as before) and at least FIRST_LOOKS looks (polls, each bounded);
- peers whose heartbeats went silent (not alive) claim more than this replica: wait up to
  `silent_periods` periods for one to beat again (a heartbeat late under load, not a death);
- otherwise give up, with the reason (`SKIP_REASONS`) and the numbers seen, which the node
  reports as a `state_download_skipped` event and one log line.

Pure: no network, no clock (the caller passes `now`); dht.state_transfer drives it.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from dht.grouping import peer_bits
from dht.heartbeat import Heartbeat
from dht.state_refusal import StateRefusal

SKIP_REASONS = ("no_live_peers", "no_donor_ahead", "all_refused", "timed_out")
"""no_live_peers: no peer alive when it looked (none yet, or all silent); no_donor_ahead: live
peers, none ahead of this replica that serves state; all_refused: every donor ahead sent a
state to refuse (or those that did not are gone); timed_out: donors ahead stayed busy or out of
reach until the patience ran out."""
JOIN_PATIENCE_S = 60.0
"""How long a joining node keeps trying donors ahead that are busy or out of reach (a relay
slot a few seconds from ready, a donor serving others): at least this, or 12 periods."""
SILENT_PERIODS = 4
"""Periods a joining node waits for silent peers that claimed to be ahead to beat again."""
FIRST_LOOKS = 4
"""Looks (the first, then one after each poll) before a node given bootstrap peers decides that
no peer is alive: on a loaded machine one poll of the heartbeat shards can outlast the two
periods and two seconds it waits by the clock."""
MAX_PAUSE_S = 8.0
"""Longest pause between two passes over busy or unreachable donors (1 s doubling)."""


@dataclass(frozen=True, kw_only=True)
class DonorLook:
    """What one read of the peers' heartbeats showed a joining node."""

    num_applied: int
    """This replica's applied count."""
    num_live: int
    num_silent_ahead: int
    """Peers known from their heartbeats, not alive now, whose last one claimed more applied."""
    best_applied: int
    """The highest applied count a live peer claims (0: none)."""
    num_ahead_not_serving: int
    donors: tuple[str, ...]
    """Live peers ahead that serve state, in the order to try them."""


def look(
    alive: list[Heartbeat],
    silent: Iterable[Heartbeat],
    num_applied: int,
    ranked: Sequence[Heartbeat],
) -> DonorLook:
    """The look at `alive` (live peers) and `silent` (known, not alive) for a replica that
    applied `num_applied`; `ranked`: the donors ahead in order (rank_donors, with its paths)."""
    ahead = [h for h in alive if h.num_applied > num_applied]
    return DonorLook(
        num_applied=num_applied,
        num_live=len(alive),
        num_silent_ahead=sum(h.num_applied > num_applied for h in silent),
        best_applied=max((h.num_applied for h in alive), default=0),
        num_ahead_not_serving=sum(not h.serves_state for h in ahead),
        donors=tuple(h.peer_id for h in ranked),
    )


@dataclass(frozen=True)
class TryDonors:
    donors: tuple[str, ...]


@dataclass(frozen=True)
class Wait:
    seconds: float


@dataclass(frozen=True)
class Skipped:
    """A join download that did not happen: why, and what was seen."""

    reason: str
    numbers: dict[str, int] = field(default_factory=dict)
    refusals: dict[str, int] = field(default_factory=dict)
    """Failed downloads per StateRefusal.reason (bad_state, busy, unreachable)."""
    waited_s: float = 0.0

    @property
    def line(self) -> str:
        n = self.numbers
        seen = (
            f"{n.get('num_live', 0)} live peer(s), best at {n.get('best_applied', 0)} applied, "
            f"this replica at {n.get('num_applied', 0)}"
        )
        tried = ", ".join(f"{v} {k}" for k, v in sorted(self.refusals.items()))
        return (
            f"no state downloaded at join ({self.reason}): {seen}"
            + (f"; failed downloads: {tried}" if tried else "")
            + f"; after {self.waited_s:.1f} s. Catching up by gossip"
        )


class JoinDownload:
    """Pass after pass: try donors, wait, or give up (and why). Not thread-safe."""

    def __init__(
        self,
        *,
        started_at: float,
        period_s: float,
        expects_peers: bool,
        patience_s: float | None = None,
    ) -> None:
        """`expects_peers`: bootstrap peers were given (a first node waits for nobody)."""
        self.started_at = started_at
        self.period_s = period_s
        self.expects_peers = expects_peers
        self.first_peers_until = started_at + 2 * period_s + 2
        patience = max(JOIN_PATIENCE_S, 12 * period_s) if patience_s is None else patience_s
        self.until = started_at + patience
        self.silent_until = min(self.until, started_at + 2 + SILENT_PERIODS * period_s)
        self.bad: set[str] = set()
        """Donors that sent a state to refuse: never tried again in this join."""
        self.refusals: Counter[str] = Counter()
        self.num_passes = 0
        self.num_looks = 0
        """Looks that found no donor (each after a poll of the heartbeats but the first)."""
        self._last: DonorLook | None = None

    def next(self, seen: DonorLook, now: float) -> TryDonors | Wait | Skipped:
        self._last = seen
        donors = tuple(d for d in seen.donors if d not in self.bad)
        if donors:
            if self.num_passes and now >= self.until:
                return self.skip("timed_out", now)
            self.num_passes += 1
            return TryDonors(donors)
        if self.num_passes:  # donors ahead were tried; none is left to try
            return self.skip("all_refused", now)
        self.num_looks += 1
        if (
            seen.num_live == 0
            and self.expects_peers
            and (now < self.first_peers_until or self.num_looks < FIRST_LOOKS)
        ):
            return Wait(0.2)
        if seen.num_silent_ahead and now < self.silent_until:
            return Wait(min(1.0, self.period_s))
        return self.skip("no_live_peers" if seen.num_live == 0 else "no_donor_ahead", now)

    def failed(self, refusal: StateRefusal) -> None:
        self.refusals[refusal.reason] += 1
        if refusal.reason == "bad_state":
            self.bad.add(refusal.donor)

    def pause_s(self) -> float:
        """The pause after a pass whose donors all failed: a second (or a period, if shorter)
        doubling, at most MAX_PAUSE_S."""
        return min(MAX_PAUSE_S, min(1.0, self.period_s) * 2.0 ** max(self.num_passes - 1, 0))

    def skip(self, reason: str, now: float) -> Skipped:
        seen = self._last
        numbers = {
            "num_applied": seen.num_applied if seen else 0,
            "num_live": seen.num_live if seen else 0,
            "best_applied": seen.best_applied if seen else 0,
            "num_silent_ahead": seen.num_silent_ahead if seen else 0,
            "num_ahead_not_serving": seen.num_ahead_not_serving if seen else 0,
            "num_donors": len(seen.donors) if seen else 0,
            "num_passes": self.num_passes,
        }
        return Skipped(reason, numbers, dict(self.refusals), round(now - self.started_at, 3))


def own_group(run_id: str, self_id: str, alive: list[Heartbeat]) -> str | None:
    """The learner group prefix this node belongs to by the live peers' heartbeats: the group
    bits most of them report at their newest epoch, applied to this node's position
    (dht.grouping); None while groups are off (no heartbeat reports bits)."""
    grouped = [h for h in alive if h.group_bits is not None and h.group_epoch is not None]
    if not grouped:
        return None
    newest = max(h.group_epoch or 0 for h in grouped)
    votes = Counter(h.group_bits for h in grouped if h.group_epoch == newest)
    bits = min(votes, key=lambda b: (-votes[b], b or 0))
    return peer_bits(run_id, self_id)[: bits or 0]


def in_group(run_id: str, prefix: str | None) -> Callable[[str], bool] | None:
    """Whether a peer id lies in the group `prefix` (None: no group, no preference)."""
    if prefix is None:
        return None
    return lambda peer_id: peer_bits(run_id, peer_id).startswith(prefix)


def spread_key(self_id: str, donor: str) -> int:
    """A tie-break among equally fit donors that differs from node to node: joining nodes
    spread over them instead of all asking the first one."""
    digest = hashlib.blake2b(f"{self_id}\x00{donor}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
