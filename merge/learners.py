"""A floor under an update's signed learner count, from what the replica applied.

Each update is sized as 1/M of a swarm round, M its author's signed count of live learners
(merge.outer). The count is a claim: an author claiming M = 1 in a swarm of ten makes every
update a whole outer step, ten times its share (only the norm bound limits it). The receiver
cannot know the author's view, but it knows what it applied: the authors of its last
`window` applied updates, and the learner counts those authors signed. The floor is

    floor = min(distinct authors in the window, lower median of the other authors' latest claims)

and an update counts as 1/max(M, floor) of a round. Honest authors of one swarm claim about
the same M, so an honest update is not changed (its own claim is at least the floor but for
a peer that just joined, which is then sized like the others); a low claim is raised to what
the other authors report. The median ignores a minority of authors claiming huge counts (a
dilution of the honest updates); the author count bounds it by the contributors actually
seen, so one honest node beside one liar is never diluted beyond the two of them.

Replicas that applied the same recent updates compute the same floor; the window is counted
in applied updates, not time, so it does not depend on clocks. Near a change of the swarm's
size replicas can differ by one author, the same order of difference as the robust filter's
median (merge.robust). Pure and not thread-safe: the pipeline calls it under the replica lock.
"""

from __future__ import annotations

from collections import Counter, deque

DEFAULT_WINDOW = 256
"""Applied updates the floor looks back over (several rounds of a large swarm)."""


class LearnerFloor:
    """The authors of the last `window` applied updates and their latest learner claims."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if type(window) is not int or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}.")
        self.window = window
        self._recent: deque[str] = deque()
        self._count: Counter[str] = Counter()
        self._claims: dict[str, int] = {}

    def floor(self, author: str) -> int:
        """The least learner count an update of `author` is sized by (1 with no history)."""
        others = sorted(claim for a, claim in self._claims.items() if a != author)
        if not others:
            return 1
        authors = len(self._claims) + (author not in self._claims)
        return max(1, min(authors, others[(len(others) - 1) // 2]))

    def effective(self, author: str, claimed: int) -> int:
        """The learner count an update claiming `claimed` is sized by."""
        return max(claimed, self.floor(author))

    def recent_authors(self, last: int) -> set[str]:
        """The distinct authors of the last `last` applied updates."""
        n = len(self._recent)
        return {self._recent[i] for i in range(max(0, n - last), n)}

    def applied(self, author: str, claimed: int) -> None:
        """An update of `author` claiming `claimed` learners was applied."""
        self._recent.append(author)
        self._count[author] += 1
        self._claims[author] = claimed
        while len(self._recent) > self.window:
            old = self._recent.popleft()
            self._count[old] -= 1
            if self._count[old] == 0:
                del self._count[old]
                del self._claims[old]

    def state_dict(self) -> dict[str, object]:
        """The window's authors in applied order and their latest claims (for checkpoints:
        a node that restarted with an empty floor sized updates unlike its peers for good)."""
        return {"recent": list(self._recent), "claims": dict(self._claims)}

    def load_state_dict(self, state: object) -> None:
        """Restores what state_dict saved; ValueError (and nothing changed) if malformed."""
        recent = state.get("recent") if isinstance(state, dict) else None
        claims = state.get("claims") if isinstance(state, dict) else None
        if not isinstance(recent, list) or not all(isinstance(a, str) for a in recent):
            raise ValueError("learner floor state 'recent' must be a list of authors.")
        if not isinstance(claims, dict) or not all(
            isinstance(a, str) and type(c) is int and c >= 1 for a, c in claims.items()
        ):
            raise ValueError("learner floor state 'claims' must map authors to counts >= 1.")
        recent = recent[-self.window :]
        if set(claims) != set(recent):
            raise ValueError("learner floor state claims other authors than its window's.")
        self._recent = deque(recent)
        self._count = Counter(recent)
        self._claims = dict(claims)
