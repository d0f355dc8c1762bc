"""What an update's author lacked: the swarm's updates signed before it that its replica had
not applied when it published.

The signed staleness (merge.weighting) is the author's own count of what it applied while its
round ran. An author alone (a home while the only public node is down, a node restarted from
its checkpoint, a newcomer training from genesis while its state check runs) applies nothing
of the others' and signs staleness 0: its updates weigh like fresh ones. They are not: each
partition's replica moved along its own path, and when the partitions meet every replica
takes the others' whole backlogs at full weight on top of its own (the NAT chaos bench,
session 15: after the public node's restart 9 staleness-0 updates took it from 2.48 to 7.04
val loss, and every home's replica rose by 1-1.4). Nothing in the counts shows it: each
replica's count grows by its own updates, so a partitioned author's `published_applied` looks
like everyone else's.

A receiver knows more once the partitions have met: it holds updates signed before the
update that its author never had. With `held` the replica's progress (merge.replica: its
applied updates counted by their credited shares, the unit of the headers' counts) signed at
or before the update's signed time and `p` the author's signed `published_applied`,

    lack = held - p

counts them, less what the author held that the receiver lacks. merge.pipeline leaves the
author's own updates out of both (its seqs below the update's held here; seq - 1 of `p`), so
a backlog taken out of order counts as in order. An update on time lacks at most the updates
of its own round still in flight: one round (M updates) is forgiven, and what it lacked
beyond that counts as staleness on top of its signed count, in full as merge.weighting's late
updates (not against the M - 1 of its own round: `lacked_updates`; merge.pipeline weighs
`rounds_stale(s + lacked, M, late=lacked)`). So a swarm's updates on time (in flight less
than a round) weigh as signed on every replica, in any order of arrival
(tests/unit/test_lack.py); a partition's backlog weighs by what the receiver holds of the
other partitions' time, which differs between replicas that took the backlogs in different
orders (and from the author's own replica, which weighed it fresh): replicas that differ
there are realigned, as after any partition (the NAT bench: drift above 0.02 at 25 of 63
measured rounds in one run, 5 of 73 in another; docs/nat.md, session 16).

Hostile input. An update counts by its credited share, as in the replica's progress, so a
flood of zeros or of budget-cut updates does not raise `held`; a liar's past-dated updates
count against others only as far as its budget lets them move the replica, and a liar
signing a low `published_applied` only lowers its own weight. Pure, not thread-safe: the
pipeline would call it under the replica lock.

Not wired on main: branch natval16 wired it into merge.pipeline (goodput 0.86-0.95x behind NAT,
so it was not landed); here it serves bench.correction_sim's ``lack`` view (docs/nat.md,
sessions 16-17).
"""

from __future__ import annotations

import bisect
import math
from collections import deque

DEFAULT_WINDOW = 1024
"""Applied updates whose signed times are kept (several rounds of a large swarm, and a
partition's backlog of a small one)."""
SLACK_ROUNDS = 1
"""Rounds of updates an update may lack and weigh as signed: its own round's, in flight."""


def lacked_updates(lack: int, learners: int, slack_rounds: int = SLACK_ROUNDS) -> int:
    """The updates an update lacked beyond `slack_rounds` rounds of the swarm (of `learners`
    updates each, its own round's in flight): staleness to add to its signed count."""
    if type(lack) is not int or lack < 0 or type(learners) is not int or learners < 1:
        raise ValueError(f"lack must be >= 0 and learners >= 1, got {lack!r}, {learners!r}.")
    return max(0, lack - slack_rounds * learners)


class LackMeter:
    """The signed times and credited shares of the replica's last `window` applied updates
    that counted (credited > 0: what the replica's progress, the headers' unit, counts)."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if type(window) is not int or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}.")
        self.window = window
        self._recent: deque[tuple[float, float]] = deque()
        self._sorted: list[tuple[float, float]] = []

    def __len__(self) -> int:
        return len(self._recent)

    def lack(self, held: int, signed_at: float, published_applied: int) -> int:
        """Of the replica's progress `held` (merge.replica: whole credited updates), what was
        signed at or before `signed_at`, beyond the author's `published_applied` (0 if none).
        Updates older than the window count as signed before it."""
        at = bisect.bisect_right(self._sorted, (signed_at, math.inf))
        later = math.fsum(credit for _, credit in self._sorted[at:])
        return max(0, math.floor(held - later + 1e-9) - published_applied)

    def applied(self, signed_at: float, credited: float) -> None:
        """An update signed at `signed_at` was applied and counted `credited` (0: not kept)."""
        if not (math.isfinite(signed_at) and math.isfinite(credited) and 0 <= credited <= 1):
            raise ValueError(f"bad signed time or credited share: {signed_at!r}, {credited!r}.")
        if credited == 0:
            return
        entry = (signed_at, credited)
        self._recent.append(entry)
        bisect.insort(self._sorted, entry)
        if len(self._recent) > self.window:
            old = self._recent.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def state_dict(self) -> dict[str, object]:
        """The window's [signed time, credited share] in applied order (checkpoints, handover:
        a replica without them weighs late updates unlike its peers)."""
        return {"recent": [[t, c] for t, c in self._recent]}

    def load_state_dict(self, state: object, held: int | None = None) -> None:
        """Restores what state_dict saved; ValueError (nothing changed) if malformed, or if
        its shares add up to more than the replica's progress `held` (None: not checked)."""
        recent = state.get("recent") if isinstance(state, dict) else None
        if not isinstance(recent, list) or not all(
            isinstance(e, list | tuple)
            and len(e) == 2
            and all(type(x) is float and math.isfinite(x) for x in e)
            and 0 < e[1] <= 1
            for e in recent
        ):
            raise ValueError("lack state 'recent' must list [signed time, share in (0, 1]].")
        if held is not None and math.fsum(c for _, c in recent) > held + 1:
            raise ValueError("lack state counts more than the replica's progress.")
        fresh = LackMeter(self.window)
        for t, c in recent[-self.window :]:
            fresh.applied(t, c)
        self._recent, self._sorted = fresh._recent, fresh._sorted
