"""A floor under an update's signed learner count, from what the replica applied.

Each update is sized as 1/M of a swarm round, M its author's signed count of live learners
(merge.outer). The count is a claim: an author claiming M = 1 in a swarm of ten makes every
update a whole outer step, ten times its share (only the norm bound limits it). The receiver
cannot know the author's view, but it knows what it applied: the last `window` applied
updates, their authors and the learner counts they signed. The floor is

    floor = min(distinct authors in the window,
                lower median over the other authors of each one's median claim in the window)

and an update counts as 1/max(M, floor) of a round. Honest authors of one swarm claim about
the same M, so an honest update is not changed (a peer that just joined, claiming fewer, is
sized like the others); a low claim is raised to what the other authors report. The median
over authors ignores a minority of authors claiming huge counts (a dilution of the honest
updates), and each author counts once however many updates it publishes; the author count
bounds the floor by the contributors actually seen, so one honest node beside one liar is
never diluted beyond the two of them.

Each author's *median* claim, not its latest: around a crash or a join the claims
are briefly M - 1 or lower, and a replica's latest claim of an author depends on which of
its updates that replica applied last. Floors from latest claims differed between replicas
there (bench.scale: 12-22 of ~100 update ids sized differently, replicas with one applied
set up to 20 % apart). A median over an author's claims in the window moves only when half
of them changed, so replicas holding the same window up to its last few updates agree (a
median over each author's last 8 claims was tried: a crash and restart changes the claims
for tens of updates, and at N = 4 it moved some authors' medians on some replicas and not
others, 10 and 31 ids sized apart). The price: after the swarm shrinks for good, the floor
stays at the old size until half of each remaining author's updates in the window claim the
new one (about window / 2N updates each; they are sized a little small meanwhile, a smaller
outer step, never a larger one); claims above the floor, as after a growth, are never
changed.

Only claims signed at or before the update being sized vote on it (merge.pipeline passes
the header's signed time). A replica that gets an update late has meanwhile applied claims
made after it; sized by those it differed from a replica that got it on time
(tests/unit/test_arrival_order.py: a newcomer's first update 50 s late was sized by 4
founders' later claims on one replica and by 3 on the other). Filtered by signed time, both
size it by what its own swarm claimed when it was made. A liar signing a future time only
withholds its own votes from earlier updates; one signing a past time votes as before.

Only authors with a track record (merge.contribution) vote and count, once any author has
one: a claim is credited only on evidence, applied updates over time. Fresh keys then do not
vote on the floor: an author with no record must not raise the divisor of established
authors' updates. Their updates are sized by the established authors' floor, their share of
each round is bounded by the cohort budget of merge.contribution, and together they count as
one live learner (`credited_learners`) only once one of them has a record of substance. While
no author has a record (a swarm's first updates) the fresh keys together are one cohort: one
vote (the median of their claims) and one author, however many keys there are.

Learner groups' updates (merge.group_pipeline) are sized and enter the window alike, the
group key as author, in the one window solo authors share: a round is a round whoever
publishes it, and a solo key in a group run is sized by the groups' claims. Their members
sign no time, so their claims enter without one (voting on every update) and every claim
votes on them; a group's claim is one number per epoch, signed alike by every member of
every group. A group key has no account of its own in merge.contribution (its members
have: they survive a regrouping); it votes on its own while most of the members that
co-signed its applied updates are counted on their own, and every group key does while no
author is established (merge.group_pipeline `floor_votes`); docs/scale.md, sessions 20 and
21, have the measurements.

Only updates that moved the replica (weight > 0, merge.pipeline) enter the window: zeros and
what a budget cut to nothing take no share of it, so a flood of valid zero updates does not
push the other authors' claims out (bench.attack zero_flood: 4 zeros a second filled it, the
honest peer was no longer among the latest authors nor voting, and honest updates were sized
as whole outer steps). Replicas that applied the same recent updates compute the same floor;
the window is counted in applied updates, not time, so it does not depend on clocks. Pure and
not thread-safe: the pipeline calls it under the replica lock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable

from merge.weighing_journal import Journaled

DEFAULT_WINDOW = 256
"""Applied updates the floor looks back over (several rounds of a large swarm)."""


class LearnerFloor(Journaled):
    """The last `window` applied updates' authors and learner claims."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if type(window) is not int or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}.")
        self.window = window
        self._recent: deque[tuple[str, int, float | None]] = deque()
        self._claims: dict[str, deque[tuple[float | None, int]]] = {}
        """Each author's (signed time, claim) in the window, in applied order."""

    def __len__(self) -> int:
        """Applied updates in the window."""
        return len(self._recent)

    def floor(
        self,
        author: str,
        credited: Callable[[str], bool] | None = None,
        cohort: bool = True,
        signed_at: float | None = None,
    ) -> int:
        """The least learner count an update of `author` signed at `signed_at` is sized by
        (1 with no history).

        ``credited``: whose claims count (the authors with a track record, merge.contribution;
        None: everyone's). Fresh keys do not count as authors seen, and vote together as one
        cohort only with ``cohort`` (while no author is established), so 40 Sybils claiming
        1,024 learners raise no honest update's divisor. ``signed_at``: only claims signed at
        or before it vote (None, or a claim without a time: every claim), so an update that
        arrives late is sized by what was claimed when it was made, not by what its receiver
        applied in the meantime: replicas that got it early and late size it alike.
        """
        claims = {
            a: [c for t, c in timed if signed_at is None or t is None or t <= signed_at]
            for a, timed in self._claims.items()
            if a != author
        }
        others = [a for a, cs in claims.items() if cs]
        counted = [a for a in others if credited is None or credited(a)]
        votes = sorted(_lower_median(claims[a]) for a in counted)
        fresh = sorted(_lower_median(claims[a]) for a in others if a not in counted)
        if fresh and cohort:  # the fresh keys: one cohort, one vote
            votes = sorted([*votes, fresh[(len(fresh) - 1) // 2]])
        if not votes:
            return 1
        return max(1, min(len(votes) + 1, votes[(len(votes) - 1) // 2]))

    def effective(
        self,
        author: str,
        claimed: int,
        credited: Callable[[str], bool] | None = None,
        cohort: bool = True,
        signed_at: float | None = None,
    ) -> int:
        """The learner count an update claiming `claimed`, signed at `signed_at`, is sized by."""
        return max(claimed, self.floor(author, credited, cohort, signed_at))

    def num_authors(self, author: str) -> int:
        """Distinct authors in the window, with `author` (the most learners a claim of its
        can be borne out by: merge.contribution's record by evidence)."""
        return len(self._claims) + (author not in self._claims)

    def recent_authors(self, last: int) -> set[str]:
        """The distinct authors of the last `last` applied updates."""
        n = len(self._recent)
        return {self._recent[i][0] for i in range(max(0, n - last), n)}

    def applied(self, author: str, claimed: int, signed_at: float | None = None) -> None:
        """An update of `author` claiming `claimed` learners, signed at `signed_at`, was
        applied."""
        self._journal("applied", author, claimed, signed_at)
        self._recent.append((author, claimed, signed_at))
        self._claims.setdefault(author, deque()).append((signed_at, claimed))
        while len(self._recent) > self.window:
            old, _, _ = self._recent.popleft()
            claims = self._claims[old]
            claims.popleft()  # the author's oldest claim in the window is the one leaving
            if not claims:
                del self._claims[old]

    def state_dict(self) -> dict[str, object]:
        """The window's authors, claims and signed times in applied order (for checkpoints: a
        node that restarted with an empty floor sized updates unlike its peers for good)."""
        return {"recent": [[a, c] if t is None else [a, c, t] for a, c, t in self._recent]}

    def load_state_dict(self, state: object) -> None:
        """Restores what state_dict saved; ValueError (and nothing changed) if malformed.
        A checkpoint of the earlier formats loads: [author, claim] entries (no signed time:
        the claim votes for every update), and authors with each one's latest claim."""
        recent = state.get("recent") if isinstance(state, dict) else None
        if not isinstance(recent, list):
            raise ValueError("learner floor state 'recent' must be a list.")
        latest = state.get("claims") if isinstance(state, dict) else None
        if isinstance(latest, dict) and all(isinstance(a, str) for a in recent):
            if set(latest) != set(recent[-self.window :]):
                raise ValueError("learner floor state claims other authors than its window's.")
            recent = [[a, latest[a]] for a in recent]
        entries = [
            (e[0], e[1], e[2] if len(e) == 3 else None)
            for e in recent
            if isinstance(e, list | tuple) and len(e) in (2, 3)
        ]
        if len(entries) != len(recent) or not all(
            isinstance(a, str) and type(c) is int and c >= 1 and _is_time(t) for a, c, t in entries
        ):
            raise ValueError(
                "learner floor state 'recent' must list [author, claim >= 1, signed time]."
            )
        fresh = LearnerFloor(self.window)
        for author, claim, signed_at in entries[-self.window :]:
            fresh.applied(author, claim, signed_at)
        self._recent, self._claims = fresh._recent, fresh._claims
        self._journal_reset()


def credited_learners(
    peers: Iterable[str],
    credited: Callable[[str], bool] | None,
    cohort: Callable[[str], bool] | None = None,
) -> int:
    """How many learners `peers` (live, contributing) count as: each one with a track
    record, and the fresh keys together as one, if any of them is ``cohort`` (None: any
    fresh key is). With ``credited`` None every peer counts: a swarm's first rounds are sized
    by everyone, never by too few. Once authors are established the pipeline counts the
    cohort only for a fresh key with an update's worth of substance in its record: a zero
    flooder counted as a learner shrank each honest update to 1/3 of a round, not 1/2
    (bench.attack zero_flood, 1.2x the clean loss), while an honest newcomer must count, or
    the established author alone beside it takes whole outer steps."""
    peers = set(peers)
    if credited is None:
        return len(peers)
    fresh = [p for p in peers if not credited(p)]
    counts = any(fresh) if cohort is None else any(map(cohort, fresh))
    return len(peers) - len(fresh) + counts


def _lower_median(claims: list[int]) -> int:
    return sorted(claims)[(len(claims) - 1) // 2]


def _is_time(t: object) -> bool:
    return t is None or (type(t) is float and math.isfinite(t))
