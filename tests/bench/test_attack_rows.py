"""bench.attack's verdicts: loss ratios against the clean runs' mean, and each target."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest

from bench.attack import honest_keys, last_val, parse_classes, wait_last_evaluation
from bench.attack_rows import (
    RunFigures,
    class_row,
    clean_means,
    clean_peaks,
    loss_ratio,
    newcomer_mean,
    paired_ratios,
)
from bench.procs import ChildProcess
from merge.identity import Identity


def run(attack: str | None, a: float | None, b: float | None, **figures: object) -> RunFigures:
    return RunFigures(attack=attack, final_val={"honest0": a, "honest1": b}, **figures)  # type: ignore[arg-type]


CLEAN = clean_means([run(None, 3.0, 3.2), run(None, 3.4, 3.0)])


def test_clean_means_are_per_node() -> None:
    assert pytest.approx({"honest0": 3.2, "honest1": 3.1}) == CLEAN


def test_a_run_is_judged_by_its_worse_node_against_that_node_s_clean_mean() -> None:
    assert loss_ratio(run("x", 3.2, 3.41), CLEAN, None) == pytest.approx(1.1)
    assert loss_ratio(run("x", 3.2, None), CLEAN, None) is None


def test_a_class_passes_on_the_mean_of_its_runs() -> None:
    row = class_row([run("x", 3.2, 3.1), run("x", 3.36, 3.1)], CLEAN, None, allow_keys=False)
    assert row["loss_ratios"] == [1.0, 1.05]
    assert row["loss_ratio_mean"] == pytest.approx(1.025)
    assert row["passed"], row["failed"]


def test_every_target_can_fail_a_class() -> None:
    bad = [
        run("x", 3.2, 3.1 * 1.2),
        run("x", 3.2, 3.1, crashed=["honest1"], tracebacks=2, rss_growth_mb=200.0,
            max_open_files=900, error="TimeoutError: x"),
    ]  # fmt: skip
    row = class_row(bad, CLEAN, None, allow_keys=False)
    assert not row["passed"]
    assert len(row["failed"]) == 6, row["failed"]
    assert row["tracebacks"] == 2 and row["rss_growth_mb"] == 200.0


def test_a_stalled_node_fails_its_class() -> None:
    row = class_row([run("x", 3.2, None)], CLEAN, None, allow_keys=False)
    assert row["loss_ratio_mean"] is None and not row["passed"]


def test_a_newcomer_that_loaded_a_poisoned_state_counts_at_its_worst_round() -> None:
    cleans = [
        run(None, 3.2, 3.1, newcomer_curve={1: 3.0, 2: 3.0, 3: 3.1}),
        run(None, 3.2, 3.1, newcomer_curve={1: 3.0, 2: 3.0, 3: 2.9}),
    ]
    poisoned = run(
        "sybil_vouchers", 3.2, 3.1, newcomer_curve={1: 3.54, 2: 3.2, 3: 2.9},
        newcomer={"donor": "adversary"},
    )  # fmt: skip
    row = class_row([poisoned], clean_means(cleans), newcomer_mean(cleans), allow_keys=False)
    assert row["loss_ratio_mean"] == pytest.approx(1.18)
    gone = run("sybil_vouchers", 3.2, 3.1, newcomer={"donor": None})
    assert loss_ratio(gone, clean_means(cleans), newcomer_mean(cleans)) is None


def test_a_newcomer_s_start_is_not_compared() -> None:
    """Its round 0 is the model it starts from (the same in every run): 1.0x, always."""
    cleans = [run(None, 3.2, 3.1, newcomer_curve={0: 5.3, 1: 3.0, 2: 3.0})] * 2
    fine = run("sybil_vouchers", 3.04, 2.9, newcomer_curve={0: 5.3, 1: 2.85, 2: 2.7},
               newcomer={"donor": "honest"})  # fmt: skip
    assert loss_ratio(fine, clean_means(cleans), newcomer_mean(cleans)) == pytest.approx(0.95)
    unfinished = run("sybil_vouchers", 3.2, 3.1, newcomer_curve={0: 5.3}, newcomer={})
    assert loss_ratio(unfinished, clean_means(cleans), newcomer_mean(cleans)) is None


def test_a_run_is_read_once_each_node_evaluated_its_last_round(tmp_path: Path) -> None:
    """Evaluations run beside training: a node lingers before its last one is done."""
    script = (
        "import json, time\n"
        "for e in ({'event': 'evaluated', 'round': 39, 'val_loss': 3.5}, {'event': 'lingering'}):\n"
        "    print(json.dumps(e), flush=True)\n"
        "time.sleep(0.5)\n"
        "print(json.dumps({'event': 'evaluated', 'round': 40, 'val_loss': 3.0}), flush=True)\n"
        "time.sleep(30)\n"
    )
    node = ChildProcess("honest1", [sys.executable, "-c", script], home=tmp_path).start()
    try:
        node.wait_event("lingering", 30)
        wait_last_evaluation(node, 40, 30)
        assert last_val(node) == 3.0
        started = time.monotonic()
        wait_last_evaluation(node, 41, 0.2)  # never comes: read as it is, after the bound
        assert last_val(node) == 3.0 and time.monotonic() - started < 5
    finally:
        node.reap()


def test_permissioned_classes_must_serve_strangers_nothing() -> None:
    refused = class_row([run("x", 3.2, 3.1)], CLEAN, None, allow_keys=True)
    assert refused["refused_at_first_message"] and refused["passed"]
    served = class_row([run("x", 3.2, 3.1, strangers_served=3)], CLEAN, None, allow_keys=True)
    assert not served["refused_at_first_message"] and not served["passed"]
    loaded = run("sybil_vouchers", 3.2, 3.1, newcomer={"donor": "adversary"})
    assert not class_row([loaded], CLEAN, None, allow_keys=True)["refused_at_first_message"]


def test_classes_name_groups_or_known_classes() -> None:
    assert parse_classes("new") == [
        "zero_flood", "summary_flood", "sideways", "sybil_learners", "sybil_vouchers"
    ]  # fmt: skip
    assert parse_classes("zero_flood,new")[0] == "zero_flood"
    assert len(parse_classes("all,new")) == len(parse_classes("all"))
    with pytest.raises(argparse.ArgumentTypeError, match="unknown classes"):
        parse_classes("zero_flod")


def test_rss_growth_is_over_the_same_node_s_clean_peak() -> None:
    cleans = [run(None, 3.2, 3.1, peak_rss_mb={"honest0": 500.0, "honest1": 520.0})] * 2
    flooded = run("summary_flood", 3.2, 3.1, peak_rss_mb={"honest0": 530.0, "honest1": 600.0})
    row = class_row([flooded], CLEAN, None, allow_keys=False, clean_peak=clean_peaks(cleans))
    assert row["rss_growth_mb"] == 80.0 and row["failed"] == ["RSS +80 MB"]


def test_paired_ratios_read_each_run_against_the_clean_run_of_its_repeat() -> None:
    cleans = [run(None, 3.0, 3.2), run(None, 3.4, 3.0)]
    attacked = [run("x", 3.3, 3.2), run("x", 3.4, 3.3)]
    assert paired_ratios(attacked, cleans) == [1.1, 1.1]
    assert paired_ratios([run("x", 3.3, 3.2)], [run(None, 3.0, None)]) == [None]


def test_every_run_gives_a_node_the_same_key_so_the_same_data_order(tmp_path: Path) -> None:
    keys = honest_keys(tmp_path)
    ids = {name: Identity.load(path).peer_id for name, path in keys.items()}
    assert sorted(ids) == ["honest0", "honest1", "newcomer"]
    assert len(set(ids.values())) == 3
