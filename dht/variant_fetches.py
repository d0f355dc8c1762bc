"""Which variant of a learner group's round a `group-done` notice makes this node fetch: pure
(dht/group_exchange_done.py does the network). Session 26 (docs/trust.md, "Two honest
variants of one round meet").

At start-up, before the census holds every peer, two disjoint subsets of one group can each
complete a round: two variants of one update id, each co-signed honestly. A replica applies
an id once and never fetches it again, so before session 26 a replica that applied one
variant never held the other, no proof formed, and the replicas kept two points at one
applied set. A notice now names its variant (`merge.group_equivocation.variant_digest`); a
node that holds or applied another variant of the round fetches the named one from the
notifier, once, and merges it: the merge refuses it as a second variant and makes the proof
(merge.group_equivocation), which every replica settles alike and passes on.

Untrusted: a digest is the notifier's word. Each (round, digest) is fetched at most once,
at most `MAX_VARIANTS_FETCHED` digests per round (an honest round has two variants; a
notifier naming made-up digests gets one fetch each up to that cap, then refusals, counted),
and a fetched update that is not the variant named is counted against the notifier.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Literal

from dht.grouping_wire import RoundId
from merge.group_equivocation import VARIANT_DIGEST_CHARS

MAX_VARIANTS_FETCHED = 2
"""Digests per round fetched from notices, at most (an honest split makes two variants)."""
MAX_ROUNDS_REMEMBERED = 1024
"""Rounds whose fetched digests are remembered (the oldest forgotten first)."""
VARIANT_WAIT_S = 30.0
"""How long a notice naming a variant waits for this replica to hold one of that round."""
VARIANT_POLL_S = 0.5
"""How often it looks while it waits."""

MAX_WATCHED = 256
"""Notices whose named variant is waited on at once, at most (each a short polling task)."""

Decision = Literal["fetch", "same", "wait", "unnamed", "fetched", "capped"]
Watch = Literal["ok", "duplicate", "capped"]


def is_digest(value: object) -> bool:
    """Whether a notice's variant field is a digest's shape (`VARIANT_DIGEST_CHARS` lowercase
    hex characters, as merge.group_equivocation.variant_digest makes them)."""
    return (
        isinstance(value, str)
        and len(value) == VARIANT_DIGEST_CHARS
        and all(c in "0123456789abcdef" for c in value)
    )


class VariantFetches:
    """Per round, the variant digests fetched because a notice named them (bounded). Not
    thread-safe: the network's loop calls it."""

    def __init__(
        self, per_round: int = MAX_VARIANTS_FETCHED, max_rounds: int = MAX_ROUNDS_REMEMBERED
    ) -> None:
        self._per_round, self._max_rounds = per_round, max_rounds
        self._rounds: OrderedDict[RoundId, tuple[set[str], set[str]]] = OrderedDict()
        """Per round: the digests fetched for notices, and those held here (at most 2 + 2)."""
        self._watching: dict[RoundId, set[str]] = {}

    def watch(self, rid: RoundId, named: str) -> Watch:
        """Whether a notice naming variant `named` of `rid` is to be watched (compared with
        the variant held here once there is one): "duplicate" while another notice of the
        same variant is, "capped" past the round's digests (`per_round` + 1: the two of an
        honest split and the one held) or past MAX_WATCHED in all (the caller counts it)."""
        names = self._watching.get(rid, set())
        if named in names:
            return "duplicate"
        total = sum(len(n) for n in self._watching.values())
        if len(names) > self._per_round or total >= MAX_WATCHED:
            return "capped"
        self._watching[rid] = names | {named}
        return "ok"

    def unwatch(self, rid: RoundId, named: str) -> None:
        names = self._watching.get(rid, set()) - {named}
        if names:
            self._watching[rid] = names
        else:
            self._watching.pop(rid, None)

    def decide(self, rid: RoundId, held: str | None, named: str | None) -> Decision:
        """What to do with a notice naming variant `named` (None: an older notice names
        none) of round `rid`, where this node holds variant `held` of it (None: none yet).
        "fetch" (the fetch is counted here: decided once per digest), "same" (the variant
        held, or one held here before: a proof swapped it), "wait" (none held yet: look
        again), "unnamed", "fetched" (asked before) or "capped" (the round's fetches are
        spent: the caller counts a refusal)."""
        if named is None:
            return "unnamed"
        if held is None:
            return "wait"
        fetched, seen = self._rounds.get(rid, (set(), set()))
        self._remember(rid, fetched, seen | {held})
        if named == held or named in seen:
            return "same"
        if named in fetched:
            return "fetched"
        if len(fetched) >= self._per_round:
            return "capped"
        self._remember(rid, fetched | {named}, seen | {held})
        return "fetch"

    def _remember(self, rid: RoundId, fetched: set[str], seen: set[str]) -> None:
        self._rounds[rid] = (fetched, seen)
        self._rounds.move_to_end(rid)
        while len(self._rounds) > self._max_rounds:
            self._rounds.popitem(last=False)

    def fetched(self, rid: RoundId) -> frozenset[str]:
        return frozenset(self._rounds.get(rid, (set(), set()))[0])


def served_refusal(rid: RoundId, named: str, served_rid: RoundId, served: str) -> str | None:
    """Why a variant fetched because a notice named `named` is counted against the notifier
    (it served another round, or another variant than it named), or None."""
    if served_rid != rid:
        return "group_done_wrong_round"
    if served != named:
        return "group_done_wrong_variant"
    return None
