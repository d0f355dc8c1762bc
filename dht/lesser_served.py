"""What a fetcher does when a holder serves the lesser variant of a group round whose proof
this replica knows and of which it applied neither (docs/scale.md session 23): the merge
refuses that variant (merge.equivocation `refuses`), and the id is still wanted, so another
holder is asked for the prevailing one. Before, the fetch settled the id as fetched on the
first such holder and the replica never took the round's step. Pure and bounded."""

from __future__ import annotations

from collections import OrderedDict

UpdateId = tuple[str, int]
MAX_LESSER_TRIES = 8
"""Holders that served the lesser variant of one id before the fetch gives up on it (then it
is settled unapplied, as a fetch refused for good is; realignment repairs the round)."""
MAX_IDS = 64
"""Ids whose tries are counted at once (the oldest forgotten first)."""


class LesserServed:
    """Per group id, how many holders served a variant the merge refused as the lesser."""

    def __init__(self, max_tries: int = MAX_LESSER_TRIES, max_ids: int = MAX_IDS) -> None:
        if max_tries < 1 or max_ids < 1:
            raise ValueError("LesserServed needs max_tries >= 1 and max_ids >= 1.")
        self.max_tries, self.max_ids = max_tries, max_ids
        self._tries: OrderedDict[UpdateId, int] = OrderedDict()
        self.num_served = 0
        """Fetches that were served a lesser variant (all ids, since start)."""
        self.num_given_up = 0
        """Ids given up on after `max_tries` holders served the lesser variant."""

    def served(self, uid: UpdateId) -> bool:
        """One more holder served the lesser variant of `uid`: True to ask another holder,
        False once `max_tries` have (the id is then forgotten here)."""
        self.num_served += 1
        tries = self._tries.pop(uid, 0) + 1
        if tries >= self.max_tries:
            self.num_given_up += 1
            return False
        self._tries[uid] = tries
        while len(self._tries) > self.max_ids:
            self._tries.popitem(last=False)
        return True

    def tries(self, uid: UpdateId) -> int:
        return self._tries.get(uid, 0)
