"""What a peer's repair summary may make this node want: bounded by what it could plausibly lack.

A summary is compact: ~170 bytes of ranges can name 2**21 update ids. Walking them (as the
receiver did, on its network loop) cost seconds and 65,536 pending fetches. Here a summary
is reduced, in time and memory proportional to its number of *ranges* (never to the ids it
names), to the ids this node could plausibly lack:

- ids this node has applied are subtracted range by range (nothing is walked);
- an author's ids above the highest seq this node has evidence of (`ceilings`: seqs it applied
  or saw in that author's signed headers) plus `seq_slack` are refused and counted as
  `beyond`: an author cannot have published them, or this node would have heard of most;
- at most `max_ids_per_author` ids per author and `max_ids` in all are kept; the rest are
  counted as `over_cap` (a later exchange names them again once the first are fetched).

Pure: no network, no clock; dht.gossip_repair runs it off the loop and counts what it refused.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from dht.ranges import Ranges, parse_ranges
from dht.transport import TransportError, decode_request

MAX_NAMED_IDS = 1 << 20
"""Ids a summary may name at all (its ranges' widths, summed, before anything is walked)."""
CeilingRule = Callable[[Mapping[str, int], Iterable[str]], Mapping[str, int]]
"""(every author's ceiling so far, the authors a summary names) -> raised ceilings."""


@dataclass(frozen=True, kw_only=True)
class SummaryLimits:
    max_ids: int = 4096
    """Ids one summary may make this node want, all authors together."""
    max_ids_per_author: int = 1024
    """Ids of one author one summary may make this node want."""
    seq_slack: int = 64
    """How far past the highest seq this node knows of an author a summary may name ids
    (updates published since this node last heard of the author)."""

    def __post_init__(self) -> None:
        for name in ("max_ids", "max_ids_per_author", "seq_slack"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}.")


@dataclass(frozen=True)
class Plausible:
    """A summary's ranges reduced to what this node lacks, and what was refused on the way."""

    ranges: Ranges = field(default_factory=dict)
    num_beyond: int = 0
    """Ids named above their author's known seq + slack (refused: cannot be honest)."""
    num_over_cap: int = 0
    """Ids this node lacks that the caps left out (asked for again in a later exchange)."""

    @property
    def num_ids(self) -> int:
        return sum(hi - lo + 1 for runs in self.ranges.values() for lo, hi in runs)


@dataclass(frozen=True)
class ReducedSummary:
    """A peer's summary as this node acts on it."""

    applied: Ranges
    """Ids the peer applied that this node lacks (within the bounds)."""
    retained: Ranges
    """Ids the peer holds that this node lacks (within the bounds): sources to fetch from."""
    num_beyond: int
    num_over_cap: int


def reduce_summary(
    blob: bytes,
    own: Ranges,
    ceilings: Mapping[str, int],
    limits: SummaryLimits,
    derive: CeilingRule | None = None,
) -> ReducedSummary:
    """A peer's summary (JSON: applied and retained ranges) reduced to what this node may lack;
    ValueError when it is malformed. `own` is this node's applied set as ranges; an author's
    ceiling is the highest of `ceilings` and of `own`, then, when `derive` is given, what it
    answers for the authors the summary names given those ceilings (authors with no evidence
    of their own: dht.gossip_groups.group_ceilings)."""
    try:
        fields = decode_request(blob)
    except TransportError as exc:
        raise ValueError(f"the summary is not a JSON object ({exc})") from None
    applied = parse_ranges(fields.get("applied"), max_ids=MAX_NAMED_IDS)
    retained = parse_ranges(fields.get("retained"), max_ids=MAX_NAMED_IDS)
    tops = dict(ceilings)
    for author, runs in own.items():
        tops[author] = max(tops.get(author, 0), runs[-1][1])
    if derive is not None:
        tops.update(derive(tops, applied.keys() | retained.keys()))
    kept = plausible_missing(applied, own, tops, limits)
    held = plausible_missing(retained, own, tops, limits)
    return ReducedSummary(
        kept.ranges,
        held.ranges,
        kept.num_beyond + held.num_beyond,
        kept.num_over_cap + held.num_over_cap,
    )


def plausible_missing(
    named: Ranges, own: Ranges, ceilings: Mapping[str, int], limits: SummaryLimits
) -> Plausible:
    """The ids of `named` that are not in `own` (this node's applied set, as ranges), within
    each author's ceiling + slack and the caps; authors in sorted order, lowest seqs first."""
    kept: Ranges = {}
    num_beyond = num_over_cap = 0
    room = limits.max_ids
    for author in sorted(named):
        top = max(0, ceilings.get(author, 0)) + limits.seq_slack
        within, beyond = _below(named[author], top)
        num_beyond += beyond
        missing = _subtract(within, own.get(author, []))
        taken, left = _take(missing, min(room, limits.max_ids_per_author))
        if taken:
            kept[author] = taken
        room -= _width(taken)
        num_over_cap += left
    return Plausible(kept, num_beyond, num_over_cap)


def take_ids(ranges: Ranges, num_ids: int) -> Ranges:
    """The first `num_ids` ids of `ranges` (authors sorted, lowest seqs first)."""
    kept: Ranges = {}
    for author in sorted(ranges):
        taken, _ = _take(ranges[author], num_ids)
        if taken:
            kept[author] = taken
            num_ids -= _width(taken)
    return kept


def _below(runs: list[tuple[int, int]], top: int) -> tuple[list[tuple[int, int]], int]:
    """`runs` cut at `top` (seqs start at 1), and how many ids were cut off."""
    within: list[tuple[int, int]] = []
    cut = 0
    for lo, hi in runs:
        lo = max(lo, 1)
        if hi > top:
            cut += hi - max(lo, top + 1) + 1
            hi = top
        if lo <= hi:
            within.append((lo, hi))
    return within, cut


def _subtract(runs: list[tuple[int, int]], own: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`runs` minus `own` (both sorted, disjoint), in O((len(runs) + len(own)) log len(own))."""
    starts = [lo for lo, _ in own]
    missing: list[tuple[int, int]] = []
    for lo, hi in runs:
        i = max(0, bisect_left(starts, lo) - 1)
        cursor = lo
        while cursor <= hi and i < len(own):
            own_lo, own_hi = own[i]
            if own_hi < cursor:
                i += 1
                continue
            if own_lo > hi:
                break
            if own_lo > cursor:
                missing.append((cursor, own_lo - 1))
            cursor = own_hi + 1
            i += 1
        if cursor <= hi:
            missing.append((cursor, hi))
    return missing


def _take(runs: list[tuple[int, int]], num_ids: int) -> tuple[list[tuple[int, int]], int]:
    """The first `num_ids` ids of `runs`, and how many were left."""
    taken: list[tuple[int, int]] = []
    left = 0
    for lo, hi in runs:
        if num_ids <= 0:
            left += hi - lo + 1
            continue
        end = min(hi, lo + num_ids - 1)
        taken.append((lo, end))
        num_ids -= end - lo + 1
        left += hi - end
    return taken, left


def _width(runs: list[tuple[int, int]]) -> int:
    return sum(hi - lo + 1 for lo, hi in runs)
