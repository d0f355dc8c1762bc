"""How many weighted sums a fetch round gathers, and where it stops when that would be too many
(merge.shard_round `ShardRound.decide`; docs/scale.md, Session 27: second27).

A round's plan gathers the fewest weighted sums of its updates that form every state tensor
(merge.shard_round_replay `combos_of`): one without a Delayed Nesterov fold, two with one, three
when its set crosses two; never more than the optimizer's state tensors (params, momentum,
round sum). Until session 27 the wiring stopped every round at its first fold and every member
fetched the updates past it whole (`in_order_deferred`); since then a round decides past its
folds and gathers two or three sums, one more fp32 slice each, as long as it asks for at most
`MAX_SUMS`. Past that (an optimizer with more state tensors than the wire carries, or a caller's
smaller bound) the round stops at the latest fold that keeps it within, and the updates after
that fold are deferred as before (`RoundPlan.deferred`). Pure.
"""

from __future__ import annotations

MAX_SUMS = 3
"""Weighted sums one round gathers at most: what a `sums` message carries
(dht.shard_fetch_wire reads at most this many tensors; the receiver bound `fetch_max_bytes`)."""


def fold_limit(until_fold: bool | int) -> int | None:
    """The fold `decide` stops after: the first (True), the n-th (n >= 1), none (False)."""
    if until_fold is True:
        return 1
    if until_fold is False:
        return None
    if until_fold < 1:
        raise ValueError("until_fold is a fold's number (1 or more), True or False.")
    return until_fold


def next_cut(num_sums: int, max_sums: int, folds: int, limit: int | None) -> int | None:
    """The fold to stop after when a plan of `num_sums` sums is decided again, or None: the
    plan (decided with the fold `limit`, None: none, taking `folds` folds) asks for at most
    `max_sums`. A plan that went on past its last fold stops at it; one that stopped at a fold
    stops at the one before. Each cut defers more (the next plan's updates are a prefix of
    this one's), so `decide` ends after at most `folds` + 1 plans. ValueError when even the
    first fold's cut needs more than `max_sums` (the caller's bound is below what the
    optimizer's state needs: a bug, not a peer's doing)."""
    if num_sums <= max_sums:
        return None
    stopped = limit is not None and folds >= limit
    if folds >= 1 and not stopped:
        return folds
    if folds >= 2:
        return folds - 1
    raise ValueError(f"a round needs {num_sums} sums, more than {max_sums}, even cut at a fold.")
