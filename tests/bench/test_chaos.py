"""A chaos run on real nodes: a killed and restarted node costs the swarm no merged update."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bench.chaos import ChaosConfig, Fault, Phase
from bench.chaos_accounting import account
from bench.procs import ChildProcess, save_events
from node.checkpoint import read_checkpoint

pytestmark = pytest.mark.swarm
MERGE_S = 120.0
"""Bounded wait for a merge on a loaded 2-core machine."""


def wait_merged(node: ChildProcess, author: str, *, after: float = 0.0) -> dict:
    return node.wait_for(
        lambda e: e.get("event") == "update_merged" and e["author"] == author and e["time"] > after,
        MERGE_S,
        f"merging an update of {author}",
    )


def applied_sets(phase: Phase) -> list[set[tuple[str, int]]]:
    sets = []
    for node in range(phase.config.nodes):
        path = phase.home / f"node{node}" / ".diloco" / "checkpoints" / phase.run_id
        state = read_checkpoint(path)
        assert state is not None, f"no checkpoint in {path}"
        applied = state["replica"]["applied"]
        sets.append({(author, seq) for author, seqs in applied.items() for seq in seqs})
    return sets


def merged_by_a_peer(phase: Phase, before: float) -> set[tuple[str, int]]:
    return {
        (e["author"], e["seq"])
        for children in phase.children
        for child in children
        for e in child.of("update_merged")
        if e["time"] < before and e["author"] != child.of("listening")[0]["peer_id"]
    }


def test_a_killed_node_loses_no_merged_update_and_contributes_again(tmp_path: Path) -> None:
    config = ChaosConfig(nodes=3, methods="async", inner_steps=10, netns=False, drain_s=0)
    phase = Phase(config, "async", tmp_path, lab=None)
    try:
        t0 = phase.start_all()
        nodes = [phase.current(n) for n in range(3)]
        ids = [n.of("started")[0]["peer_id"] for n in nodes]  # they train, then listen
        for child in nodes:
            for other in ids:
                wait_merged(child, other)
        victim = 1
        killed_at = time.time()
        restart = phase.inject(Fault(0.0, victim, "kill", 2.0))
        time.sleep(2.0)
        restart()
        restarted_at = phase.current(victim).wait_event("started", MERGE_S)["time"]
        for merger in range(3):  # all three contribute again: each merges the other two
            for author in set(range(3)) - {merger}:
                wait_merged(phase.current(merger), ids[author], after=restarted_at)
        t1 = time.time()
    finally:
        phase.stop_all()  # kills whatever outlived a node, torch_shm_manager included
        if folder := os.environ.get("DILOCO_TEST_EVENTS_DIR"):  # as the swarm tests'
            children = [c for incarnations in phase.children for c in incarnations]
            (Path(folder) / "chaos" / phase.method).mkdir(parents=True, exist_ok=True)
            save_events(children, Path(folder) / "chaos")  # chaos/async/node0.jsonl, ...
    leftovers = [p for children in phase.children for c in children for p in c.leftovers()]
    assert leftovers == [], leftovers
    before_kill = merged_by_a_peer(phase, killed_at)
    assert before_kill, "updates should have been merged before the kill"
    for node, applied in enumerate(applied_sets(phase)):
        assert before_kill <= applied, (node, sorted(before_kill - applied))
    figures = account(phase.slots, t0, t1, synchronous=False, window_s=5.0)
    assert figures["restarts"] == 1
    assert all(n["merged_any_s"] > 0 for n in figures["per_node"]), figures["per_node"]
