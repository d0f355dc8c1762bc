"""Update ids as per-author seq ranges: what summaries and holder records name, and their
parsing from untrusted JSON (bounded before anything is walked)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

UpdateId = tuple[str, int]
Ranges = dict[str, list[tuple[int, int]]]
"""Per author, sorted disjoint inclusive seq ranges: {"alice": [(1, 4), (7, 7)]}."""
MAX_SUMMARY_AUTHORS = 1024
MAX_RANGES_PER_AUTHOR = 4096


def to_ranges(seqs_by_author: Mapping[str, Iterable[int]]) -> Ranges:
    """{author: seqs} as sorted disjoint inclusive ranges."""
    ranges: Ranges = {}
    for author, seqs in seqs_by_author.items():
        runs = to_runs(seqs)
        if runs:
            ranges[author] = runs
    return ranges


def to_runs(seqs: Iterable[int]) -> list[tuple[int, int]]:
    """`seqs` as sorted disjoint inclusive ranges."""
    runs: list[tuple[int, int]] = []
    for seq in sorted(set(seqs)):
        if runs and seq == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], seq)
        else:
            runs.append((seq, seq))
    return runs


def iter_ids(ranges: Ranges) -> Iterable[UpdateId]:
    for author, runs in ranges.items():
        for lo, hi in runs:
            for seq in range(lo, hi + 1):
                yield (author, seq)


def parse_ranges(value: object, *, max_ids: int) -> Ranges:
    """Ranges from untrusted JSON; ValueError when malformed or naming more than max_ids ids."""
    if not isinstance(value, dict) or len(value) > MAX_SUMMARY_AUTHORS:
        raise ValueError("a summary must map at most 1024 authors to seq ranges")
    ranges: Ranges = {}
    total = 0
    for author, runs in value.items():
        if not isinstance(author, str) or not 0 < len(author) <= 128:
            raise ValueError("a summary author must be a short string")
        if not isinstance(runs, list) or len(runs) > MAX_RANGES_PER_AUTHOR:
            raise ValueError("a summary lists too many ranges")
        parsed = [_parse_run(run) for run in runs]
        total += sum(hi - lo + 1 for lo, hi in parsed)
        if total > max_ids:
            raise ValueError(f"a summary names more than {max_ids} updates")
        ranges[author] = parsed
    return ranges


def _parse_run(run: object) -> tuple[int, int]:
    if (
        not isinstance(run, list | tuple)
        or len(run) != 2
        or not all(type(v) is int for v in run)
        or not 0 <= run[0] <= run[1]
    ):
        raise ValueError("a summary range must be [lo, hi] with 0 <= lo <= hi")
    return (run[0], run[1])
