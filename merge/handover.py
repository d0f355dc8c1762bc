"""What a newcomer takes over from its donor besides the replica: the merge state, checked.

A state transfer carried the replica alone (params, outer state, applied set). The newcomer
then judged the next updates with empty robust windows and sized them with an empty learner
floor while its donor used full ones: bench.scale at N = 8 kept about one update id per run
that some replicas clipped as a norm outlier and others did not, so replicas with one applied
set stayed apart. The donor now sends what its pipeline decides by (robust windows, learner
floor, proofs of equivocation) taken with the replica at one moment, and the newcomer decides
as its donor would.

The donor is untrusted. Its params and applied set were checked against the live peers
(dht.state_check) before any of this is read, but no peer signs its windows, so they are held
to what the applied set and the norm cap allow:

- learner floor: every entry names an author of the applied set, no author more often than
  it has applied updates, at most `window` entries, claims integers >= 1 (merge.learners
  validates the format);
- robust windows: finite norms >= 0, none above twice the norm cap of the donor's own params
  (the pipeline refuses any update above the cap, so no applied update was recorded there;
  twice: the params' norm moved since the oldest entries were recorded);
- robust windows' authors and the contribution ledger (merge.contribution): authors of the
  applied set, or members of learner groups the co-sign ledger (merge.cosign_ledger, checked
  against the applied set) says co-signed applied group updates, none credited with more
  updates than it applied or co-signed (allowances are at most one), no more rounds in all
  than updates applied. A donor can still overstate an author's record up to that count
  (making it established sooner here) or understate it;
- proofs of equivocation: each checked (two valid signatures of this run, conflicting
  payloads; in a permissioned run every signer on the run's list, merge.equivocation
  .admitted_only); an id counts as settled only if the donor applied it.

What a corroborated donor can still lie about is bounded: false norms inside the cap loosen or
tighten the newcomer's relative bound until half the window is its own applied updates (16 of
32 by default; the absolute cap holds throughout), and false claims move the floor no further
than the applied set's author count. A newcomer without the handover had no relative bound at
all for its first `warmup` updates and no floor for a window's worth.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping, Set

NORM_CAP_SLACK = 2.0
"""Recorded norms may exceed the cap of the donor's params by this factor (the params' norm
moved since the oldest were recorded); no further."""


class HandoverError(ValueError):
    """A donor's merge state that its replica does not allow."""


def check_handover(
    merge: object,
    applied: Mapping[str, Set[int]],
    *,
    norm_cap: float,
    window: int,
    cosigned: Mapping[str, Mapping[str, int]] | None = None,
) -> None:
    """Raises HandoverError unless `merge` (a pipeline's state_dict, from a donor) fits the
    replica it came with: `applied` its applied set, `cosigned` its co-sign ledger's counts
    (merge.cosign_ledger.parse_cosigned: already held to `applied`), `norm_cap` the largest
    norm the pipeline accepts against its params. Checks what the formats' own loaders
    cannot know."""
    if not isinstance(merge, Mapping):
        raise HandoverError("a donor's merge state must be a mapping.")
    floor = merge.get("learner_floor")
    recent = floor.get("recent") if isinstance(floor, Mapping) else None
    if not isinstance(recent, list):
        raise HandoverError("a donor's learner floor must list its recent updates.")
    if len(recent) > window:
        raise HandoverError(f"a donor's learner floor holds {len(recent)} > {window} updates.")
    counts: collections.Counter[str] = collections.Counter()
    for entry in recent:
        author = entry[0] if isinstance(entry, list | tuple) and entry else None
        if not isinstance(author, str) or author not in applied:
            raise HandoverError("a donor's learner floor names an author it never applied.")
        counts[author] += 1
        if counts[author] > len(applied[author]):
            raise HandoverError(
                f"a donor's learner floor holds more updates of {author} than it applied."
            )
    robust = merge.get("robust")
    if not isinstance(robust, list):
        raise HandoverError("a donor's robust windows must be a list.")
    bound = NORM_CAP_SLACK * norm_cap
    for state in robust:
        norms = state.get("norms") if isinstance(state, Mapping) else None
        if not isinstance(norms, list) or not all(
            isinstance(n, float) and math.isfinite(n) and 0 <= n <= bound for n in norms
        ):
            raise HandoverError(
                f"a donor's robust window holds a norm that is not finite in [0, {bound:.4g}]."
            )
        _check_counts(state.get("authors", []), applied, "robust window")
    _check_ledger(merge.get("ledger"), applied, cosigned or {})


def _check_counts(authors: object, applied: Mapping[str, Set[int]], what: str) -> None:
    """Every author of `authors` was applied, and is named no more often than it was ("":
    a window loaded from a checkpoint before authors were kept)."""
    if not isinstance(authors, list):
        raise HandoverError(f"a donor's {what} must list its authors.")
    counts = collections.Counter(a for a in authors if isinstance(a, str))
    for author, count in counts.items():
        limit = sum(map(len, applied.values())) if author == "" else len(applied.get(author, ()))
        if count > limit:
            raise HandoverError(f"a donor's {what} names {author!r} more often than it applied.")


def _check_ledger(
    ledger: object, applied: Mapping[str, Set[int]], cosigned: Mapping[str, Mapping[str, int]]
) -> None:
    """A donor's contribution ledger (merge.contribution) credits no author more updates than
    it applied or co-signed (allowances are at most one: a group update credits each
    co-signer at most one update's record), and no more rounds in all than updates applied
    (a group update's members together advance the clock by at most its one share)."""
    if ledger is None:
        return  # a donor from before budgets: the newcomer starts without track records
    rows = ledger.get("accounts") if isinstance(ledger, Mapping) else None
    total = ledger.get("total") if isinstance(ledger, Mapping) else None
    if not isinstance(rows, list) or not isinstance(total, int | float):
        raise HandoverError("a donor's contribution ledger must hold a total and accounts.")
    num_applied = sum(map(len, applied.values()))
    if not total <= num_applied:
        raise HandoverError("a donor's contribution ledger credits more than it applied.")
    for row in rows:
        if (
            not isinstance(row, list | tuple)
            or len(row) not in (6, 7)
            or not isinstance(row[0], str)
        ):
            raise HandoverError(
                "a donor's contribution ledger accounts must be [author, 5 or 6 numbers]."
            )
        author, record = row[0], row[4]
        if author != "" and author not in applied and author not in cosigned:
            raise HandoverError("a donor's contribution ledger names an author it never applied.")
        cosigned_count = sum(cosigned.get(author, {}).values())
        limit = num_applied if author == "" else len(applied.get(author, ())) + cosigned_count
        if not isinstance(record, int | float) or not record <= limit:
            raise HandoverError(
                f"a donor's contribution ledger credits {author!r} more than it applied."
            )


def settled_in(settled: object, applied: Mapping[str, Set[int]]) -> list[list[object]]:
    """The settled ids of a donor's equivocation state that its applied set holds (an id is
    settled only once this replica applied it or recorded it as contributing nothing)."""
    if not isinstance(settled, list):
        return []
    return [
        [entry[0], entry[1]]
        for entry in settled
        if isinstance(entry, list | tuple)
        and len(entry) == 2
        and isinstance(entry[0], str)
        and type(entry[1]) is int
        and entry[1] in applied.get(entry[0], ())
    ]
