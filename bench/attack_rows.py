"""bench.attack's verdicts: per class, what the honest nodes lost and counted, against targets.

Pure: it reads the figures of finished runs (bench.attack.RunFigures) and decides; nothing
here starts a process. The targets (issue 20):

- each class, both honest nodes' final validation loss within LOSS_TOLERANCE of the clean
  runs' (the ratio of a run is its worse node's final loss over that node's mean over the
  clean runs; a class passes on the mean of its runs' ratios);
- no crash, no traceback in an honest node's log, no error in the adversary's class;
- RSS growth (an honest main process's peak resident set over the same node's mean peak in
  the clean runs: a node's RSS grows by ~190 MB over a clean run as it warms up, so growth
  within a run says little) at most MAX_RSS_GROWTH_MB, open files at most
  MAX_OPEN_FILES_SEEN;
- with --allow-keys, no update of a key the list lacks fetched or merged by an honest node
  and no state loaded from one: refused at the first message.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

LOSS_TOLERANCE = 0.05
MAX_RSS_GROWTH_MB = 60.0
MAX_OPEN_FILES_SEEN = 512
"""Open files a node may reach during a class (half its limit of 1024: a flood that leaks a
descriptor per message crosses it within seconds)."""


@dataclass(kw_only=True)
class RunFigures:
    """What one run (clean or attacked by one class) left, as bench.attack measured it."""

    attack: str | None
    final_val: dict[str, float | None]
    """The final validation loss of each honest node that trains the whole run, by name."""
    newcomer_curve: dict[int, float] = field(default_factory=dict)
    """The newcomer's validation loss after each of its rounds (runs with a newcomer): a
    poisoned state costs most right after it is loaded, and the newcomer mends within its
    few rounds (sybil_vouchers: 1.17x after round 1, 0.96x after round 3). Its round 0 is its
    start, evaluated before it loads any state: not compared (NEWCOMER_FIRST_ROUND)."""
    newcomer_round: int | None = None
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    """Each honest node's (of those training the whole run) highest RSS sample, by name."""
    rss_growth_mb: float = 0.0
    """How far an honest node's RSS rose within the run after the class started (shown)."""
    max_open_files: int = 0
    tracebacks: int = 0
    crashed: list[str] = field(default_factory=list)
    counted: dict[str, int] = field(default_factory=dict)
    error: str | None = None
    rounds_advanced: int = 0
    newcomer: dict[str, Any] | None = None
    strangers_served: int = 0
    """Updates of keys that are no honest node's fetched or merged by an honest node."""
    learners: list[int] = field(default_factory=list)
    """The learner counts M honest updates were sized by, from the class's start on."""
    seconds: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    """CPU seconds of each process tree (node or adversary, with its p2pd and DHT processes)
    from the class's start to its end (a clean run: from honest0's round 4 to the end)."""
    tail_val: dict[str, float | None] = field(default_factory=dict)
    """Each honest node's mean val loss over its last few evaluated rounds (shown)."""


def clean_means(cleans: list[RunFigures]) -> dict[str, float]:
    """Each node's mean final validation loss over the clean runs that have one."""
    return _means_by_node(run.final_val for run in cleans)


def clean_tails(cleans: list[RunFigures]) -> dict[str, float]:
    """Each node's mean over the clean runs of its mean val loss over its last rounds."""
    return _means_by_node(run.tail_val for run in cleans)


def _means_by_node(runs: Iterable[dict[str, float | None]]) -> dict[str, float]:
    by_node: dict[str, list[float]] = {}
    for values in runs:
        for name, val in values.items():
            if val is not None:
                by_node.setdefault(name, []).append(val)
    return {name: statistics.fmean(vals) for name, vals in by_node.items()}


def tail_ratio(run: RunFigures, clean_tail: dict[str, float]) -> float | None:
    """The worse honest node's mean loss over its last rounds over the clean runs' same
    mean (shown, not deciding: a level read over more rounds than the final one)."""
    ratios = [
        v / clean_tail[n] for n, v in run.tail_val.items() if v is not None and n in clean_tail
    ]
    return round(max(ratios), 4) if ratios else None


def mean_cpu_s(runs: list[RunFigures]) -> dict[str, float]:
    """Each process tree's mean CPU seconds over `runs` (those that measured it)."""
    by_name: dict[str, list[float]] = {}
    for run in runs:
        for name, cpu in run.cpu_s.items():
            by_name.setdefault(name, []).append(cpu)
    return {name: round(statistics.fmean(v), 1) for name, v in sorted(by_name.items())}


def clean_peaks(cleans: list[RunFigures]) -> dict[str, float]:
    """Each node's mean peak RSS over the clean runs."""
    by_node: dict[str, list[float]] = {}
    for run in cleans:
        for name, peak in run.peak_rss_mb.items():
            by_node.setdefault(name, []).append(peak)
    return {name: statistics.fmean(peaks) for name, peaks in by_node.items()}


def rss_growth(runs: list[RunFigures], clean_peak: dict[str, float]) -> float:
    """The most an honest node's peak RSS exceeded its clean mean peak, over `runs`."""
    return max(
        (
            peak - clean_peak[n]
            for r in runs
            for n, peak in r.peak_rss_mb.items()
            if n in clean_peak
        ),
        default=0.0,
    )


NEWCOMER_FIRST_ROUND = 1
"""The first newcomer round compared with the clean newcomers': its round 0 is the model it
starts from, evaluated before any state is loaded, the same in every run, so it read 1.000x
in every run and floored each newcomer class's ratio at 1.0 (flood12: sybil_vouchers 1.000x,
1.000x with its honest pair at 0.951x and 0.984x)."""


def newcomer_mean(cleans: list[RunFigures]) -> dict[int, float]:
    """The clean newcomers' mean validation loss after each of their rounds."""
    by_round: dict[int, list[float]] = {}
    for run in cleans:
        for round_, val in run.newcomer_curve.items():
            by_round.setdefault(round_, []).append(val)
    return {r: statistics.fmean(vals) for r, vals in sorted(by_round.items())}


def loss_ratio(
    run: RunFigures, clean: dict[str, float], clean_newcomer: dict[int, float] | None
) -> float | None:
    """The worse honest node's final loss over its clean mean, and where a newcomer joined,
    its worst loss after any of its rounds (from NEWCOMER_FIRST_ROUND) over the clean
    newcomers' after the same round; None when a node has no final loss (it crashed or
    stalled) or the newcomer finished no round."""
    ratios = []
    for name, base in clean.items():
        val = run.final_val.get(name)
        if val is None:
            return None
        ratios.append(val / base)
    if clean_newcomer and run.newcomer is not None:
        curve = run.newcomer_curve
        common = [r for r in curve if r >= NEWCOMER_FIRST_ROUND and r in clean_newcomer]
        if not common:
            return None
        ratios += [curve[r] / clean_newcomer[r] for r in common]
    return max(ratios) if ratios else None


def paired_ratios(runs: list[RunFigures], cleans: list[RunFigures]) -> list[float | None]:
    """Each attacked run's loss ratio against the clean run of the same repeat alone (run i
    beside clean run i: same keys, same data order, neighbours in time, so under one load):
    shown beside the ratios against the clean mean, which decide."""
    ratios: list[float | None] = []
    for run, base in zip(runs, cleans, strict=False):
        clean = {n: v for n, v in base.final_val.items() if v is not None}
        if len(clean) != len(base.final_val):
            ratios.append(None)
            continue
        ratio = loss_ratio(run, clean, base.newcomer_curve or None)
        ratios.append(None if ratio is None else round(ratio, 4))
    return ratios


def class_row(
    runs: list[RunFigures],
    clean: dict[str, float],
    clean_newcomer: dict[int, float] | None,
    *,
    allow_keys: bool,
    clean_peak: dict[str, float] | None = None,
    clean_tail: dict[str, float] | None = None,
) -> dict[str, Any]:
    """One class's row: its runs' figures and whether it meets every target (RSS growth over
    `clean_peak`, or within the runs without one)."""
    ratios = [loss_ratio(r, clean, clean_newcomer) for r in runs]
    known = [r for r in ratios if r is not None]
    mean = statistics.fmean(known) if known and len(known) == len(ratios) else None
    counted: Counter[str] = Counter()
    for run in runs:
        counted.update(run.counted)
    row: dict[str, Any] = {
        "class": runs[0].attack,
        "loss_ratio_mean": None if mean is None else round(mean, 4),
        "loss_ratios": [None if r is None else round(r, 4) for r in ratios],
        "rss_growth_mb": round(
            rss_growth(runs, clean_peak) if clean_peak else max(r.rss_growth_mb for r in runs), 1
        ),
        "rss_growth_in_run_mb": round(max(r.rss_growth_mb for r in runs), 1),
        "peak_rss_mb": round(max(max(r.peak_rss_mb.values(), default=0.0) for r in runs), 1),
        "max_open_files": max(r.max_open_files for r in runs),
        "tracebacks": sum(r.tracebacks for r in runs),
        "counted": dict(sorted(counted.items())),
        "crashed": sorted({n for r in runs for n in r.crashed}),
        "errors": [r.error for r in runs if r.error],
        "rounds_advanced": min(r.rounds_advanced for r in runs),
        "seconds": [round(r.seconds) for r in runs],
        "tail_ratios": [tail_ratio(r, clean_tail or {}) for r in runs],
        "cpu_s": mean_cpu_s(runs),
    }
    learners = [m for r in runs for m in r.learners]
    row["learners"] = [min(learners), max(learners)] if learners else None
    if any(r.newcomer is not None for r in runs):
        row["newcomer"] = [r.newcomer for r in runs]
        row["newcomer_rounds"] = [r.newcomer_round for r in runs]
    if allow_keys:
        row["strangers_served"] = sum(r.strangers_served for r in runs)
        row["refused_at_first_message"] = refused_at_first_message(runs)
    row["failed"] = failures(row, allow_keys=allow_keys)
    row["passed"] = not row["failed"]
    return row


def refused_at_first_message(runs: list[RunFigures]) -> bool:
    """Nothing of the stranger's was fetched, merged or loaded as state by an honest node."""
    loaded = any(r.newcomer and r.newcomer.get("donor") == "adversary" for r in runs)
    return not loaded and all(r.strangers_served == 0 for r in runs)


def failures(row: dict[str, Any], *, allow_keys: bool) -> list[str]:
    """The targets `row` misses, each in a few words (empty: it passes)."""
    failed = []
    mean = row["loss_ratio_mean"]
    if mean is None:
        failed.append("no final loss")
    elif mean > 1 + LOSS_TOLERANCE:
        failed.append(f"loss x{mean:.3f}")
    if row["crashed"]:
        failed.append(f"crashed: {row['crashed']}")
    if row["tracebacks"]:
        failed.append(f"{row['tracebacks']} tracebacks")
    if row["errors"]:
        failed.append("adversary error")
    if row["rss_growth_mb"] > MAX_RSS_GROWTH_MB:
        failed.append(f"RSS +{row['rss_growth_mb']:.0f} MB")
    if row["max_open_files"] > MAX_OPEN_FILES_SEEN:
        failed.append(f"{row['max_open_files']} open files")
    if allow_keys and not row["refused_at_first_message"]:
        failed.append("a stranger was served")
    return failed


def format_row(row: dict[str, Any]) -> str:
    mean = row["loss_ratio_mean"]
    ratios = ", ".join("-" if r is None else f"{r:.3f}" for r in row["loss_ratios"])
    counted = ", ".join(f"{k}={v}" for k, v in row["counted"].items()) or "-"
    verdict = "pass" if row["passed"] else "FAIL " + "; ".join(row["failed"])
    text = (
        f"{row['class']:<18} loss x{'-' if mean is None else f'{mean:.3f}':<6} ({ratios})  "
        f"rss +{row['rss_growth_mb']:.0f} MB  fds {row['max_open_files']}  "
        f"tracebacks {row['tracebacks']}  rounds +{row['rounds_advanced']}  {verdict}\n"
        f"{'':<18} counted: {counted}"
    )
    if row["learners"]:
        text += f"; honest updates sized by M {row['learners'][0]}-{row['learners'][1]}"
    tails = ", ".join("-" if r is None else f"{r:.3f}" for r in row.get("tail_ratios", []))
    text += f"\n{'':<18} last rounds' loss x({tails}); CPU s during the class {row.get('cpu_s')}"
    if "newcomer" in row:
        text += f"\n{'':<18} newcomer: {row['newcomer']}"
    if "refused_at_first_message" in row:
        text += f"\n{'':<18} refused at the first message: {row['refused_at_first_message']}"
    return text
