"""A real swarm on 127.0.0.1: discovery, gossip, failures, newcomers, stragglers, forgeries."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest

from dht.observer import SwarmObserver
from merge.identity import Identity
from tests.conftest import REPO
from tests.swarm.conftest import NodeProcess, observed_heartbeats
from tests.swarm.together import bootstrap_address, unused_port
from tests.timeouts import EXIT_S, MERGE_S, START_S, covering

pytestmark = pytest.mark.swarm
Launch = Callable[..., NodeProcess]
# Every node in a test shares these, so their run fingerprints agree.
RUN = ["--model", "tiny", "--threads", "1", "--inner-steps", "10", "--eval-batches", "2",
       "--heartbeat-period", "1"]  # fmt: skip
EVAL_S = 60
HIVEMIND_DHT_S = 60  # a plain hivemind-dht printing its address
STATUS_S = 120
FORGER_S = 180
REALIGN_S = 180  # drift noticed (two heartbeats), a state downloaded, three rounds measured
MAX_DRIFT = 0.05
"""How far replicas that applied the same set may be once realignment had its chance
(dht.realign realigns beyond 0.02)."""


def merged_from(node: NodeProcess, author: str) -> list[dict]:
    return [e for e in node.of("update_merged") if e["author"] == author]


def wait_merged(node: NodeProcess, author: str, *, after_seq: int = 0, timeout_s: float = MERGE_S):
    return node.wait_for(
        lambda e: (
            e.get("event") == "update_merged" and e["author"] == author and e["seq"] > after_seq
        ),
        timeout_s,
        f"{node.name} merging an update of {author} after seq {after_seq}",
    )


def wait_aligned(
    node: NodeProcess, since: float, rounds: int = 3, timeout_s: float = REALIGN_S
) -> dict:
    """`node`'s round_done that ends `rounds` rounds in a row, finished after `since` (a
    time.time()), whose drift was measured (a peer held an applied set it held too) and
    within MAX_DRIFT."""
    in_a_row = [0]

    def aligned(e: dict) -> bool:
        if e.get("event") != "round_done" or e["drift"] is None or e["time"] <= since:
            return False
        in_a_row[0] = in_a_row[0] + 1 if e["drift"] < MAX_DRIFT else 0
        return in_a_row[0] >= rounds

    return node.wait_for(aligned, timeout_s, f"{rounds} rounds in a row of drift < {MAX_DRIFT}")


def wait_merged_again(node: NodeProcess, realigned: dict, timeout_s: float = MERGE_S) -> None:
    """Every update a `realigned` event lists as lacking from the donor's state is merged by
    `node` after it."""
    missing = {tuple(uid) for uid in realigned["lacking"]}

    def merged(e: dict) -> bool:
        if e.get("event") == "update_merged" and e["time"] >= realigned["time"]:
            missing.discard((e["author"], e["seq"]))
        return not missing

    node.wait_for(merged, timeout_s, f"merging again what the donor lacked: {sorted(missing)}")


def _round_of_two(e: dict, *, after: float) -> bool:
    return e.get("event") == "round_done" and e["peers_alive"] == 2 and e["time"] > after


def _evaluated(e: dict, *, at: int) -> bool:
    return e.get("event") == "evaluated" and e["round"] >= at


def start_swarm(launch: Launch, keys: Path, count: int, *extra: str) -> list[NodeProcess]:
    """`count` nodes launched at once (tests/swarm/together.py): node0's identity file (made in
    `keys`) and a port picked here give its address before it listens, and the others dial it
    with their own backoff until it does."""
    keys.mkdir(parents=True)
    key, port = keys / "node0.key", unused_port()
    Identity.generate().save(key)
    maddr = bootstrap_address(str(key), port)
    first = launch(*RUN, *extra, "--identity", str(key), "--port", str(port), name="node0")
    rest = [launch(*RUN, *extra, "--peers", maddr, name=f"node{i}") for i in range(1, count)]
    assert maddr in first.wait_listening(START_S), "node0 listens where the others were sent"
    for node in rest:
        node.wait_listening(START_S)
    return [first, *rest]


@pytest.mark.timeout(covering(4 * START_S, 18 * MERGE_S, EVAL_S, STATUS_S, 3 * REALIGN_S))
def test_three_nodes_train_together_a_straggler_delays_nobody_and_they_survive_the_bootstrap_dying(
    launch: Launch, tmp_path: Path
) -> None:
    """One swarm of three for three facts, one after another: they train together (and their
    replicas settle), a paused node delays nobody and its late updates weigh less, and the two
    left train on and take in a newcomer once the bootstrap is killed."""
    nodes = start_swarm(launch, tmp_path / "keys", 3)
    for node in nodes:
        for other in nodes:
            if other is not node:
                wait_merged(node, other.peer_id)

    # node0 starts from the untrained model; node1 and node2 may start from a state downloaded
    # a few rounds in, whose loss the next rounds' noise can exceed (2.953 vs 2.933 in CI), so
    # every node is judged against the untrained model's loss (byte-level: ~ln 256).
    untrained = nodes[0].wait_event("evaluated", EVAL_S)["val_loss"]
    for node in nodes:
        # A round finished after the merges above, not the first with two peers alive.
        merged_at = max(e["time"] for e in node.of("update_merged"))
        latest = node.wait_for(
            partial(_round_of_two, after=merged_at), MERGE_S, "a round after the merges"
        )
        evaluated = node.wait_for(  # that round's replica, evaluated beside training
            partial(_evaluated, at=latest["round"]), MERGE_S, "the evaluation of that round"
        )
        assert evaluated["val_loss"] < 0.8 * untrained, (node.name, evaluated, untrained)
    # Replicas that applied the same set settle within MAX_DRIFT of each other once
    # realignment had its chance: merge decisions that depend on arrival order (the learner
    # floor at start-up, robust verdicts near a threshold) can set one 0.13 apart for good,
    # and dht.realign then loads a donor's state into it. A replica that stays apart, or
    # whose applied set never again equals a peer's (its own updates lost in the swap: no
    # drift is measured then), fails here.
    since = time.time()
    for node in (nodes[0], nodes[1], nodes[2]):
        wait_aligned(node, since)
    realigned = [(n, e) for n in nodes for e in n.of("realigned")]
    assert len(realigned) <= 2, [e for _, e in realigned]
    for node, event in realigned:
        assert event["distance_before"] > 0.02 and event["donor"] != node.peer_id, event
        # what the donor lacked and this node had applied (its own last updates among them)
        wait_merged_again(node, event)

    # No --peers: status finds node1 through its control file in node1's HOME.
    status = subprocess.run(
        [sys.executable, "-m", "node", "status", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=STATUS_S,
        env={**os.environ, "HOME": str(nodes[1].home)},
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    assert f"nodes on this machine: {nodes[1].peer_id}" in status.stderr
    run = json.loads(status.stdout)["runs"][0]
    peers = run["peers"]
    assert {p["peer_id"] for p in peers} == {n.peer_id for n in nodes}
    assert all(p["state"] == "training" and p["applied"] > 0 for p in peers)
    for count in ("lost", "need_state"):  # each peer's heartbeat, and the swarm's sum of them
        assert run["summary"][count] == sum(p[count] for p in peers), (count, run["summary"])

    straggler_delays_nobody(*nodes)

    bootstrap, b, c = nodes
    bootstrap.kill()  # kill -9 of the first node's main process
    # The newcomer starts at once (through b, not the dead bootstrap): its start-up (~5-10 s
    # of imports and its DHT member) runs while the two left show they train on without the
    # bootstrap, which it does not change: each of them merges the other's updates after the
    # kill whoever else joins.
    newcomer = launch(*RUN, "--peers", b.maddrs[0], name="node3")
    assert bootstrap.leftover_processes() == [], "its DHT process and p2pd must not outlive it"
    last_b = max(e["seq"] for e in merged_from(c, b.peer_id))
    last_c = max(e["seq"] for e in merged_from(b, c.peer_id))
    wait_merged(c, b.peer_id, after_seq=last_b + 2)
    wait_merged(b, c.peer_id, after_seq=last_c + 2)

    downloaded = newcomer.wait_for_event("state_downloaded", START_S)
    assert downloaded["num_applied"] > 0 and downloaded["megabytes"] > 1
    # It judges and sizes the next updates by its donor's windows, not empty ones.
    assert 0 < downloaded["floor_updates"] <= downloaded["num_applied"]
    assert downloaded["robust_norms"] > 0
    first_own = wait_merged(newcomer, newcomer.peer_id)
    for old in (b, c):
        merged = wait_merged(old, newcomer.peer_id, after_seq=first_own["seq"] - 1)
        assert merged["seq"] == first_own["seq"]


@pytest.mark.timeout(covering(6 * START_S, 3 * MERGE_S))
def test_a_node_frozen_past_the_gap_wait_comes_back_to_the_same_applied_set(
    launch: Launch, tmp_path: Path
) -> None:
    gap_wait_s, frozen_s = 3, 6  # frozen twice the gap wait
    nodes = start_swarm(launch, tmp_path / "keys", 3, "--gap-wait", str(gap_wait_s),
                        "--max-rounds", "6", "--linger", "90")  # fmt: skip
    a, b, c = nodes
    wait_merged(c, a.peer_id)
    wait_merged(c, b.peer_id)
    c.pause()  # the whole node: learner, DHT process and p2pd
    try:
        time.sleep(frozen_s)  # the freeze itself is the fault under test
    finally:
        c.resume()
    for node in nodes:
        node.wait_for_event("lingering", START_S)  # its last update is published
    published = {n.peer_id: max(e["seq"] or 0 for e in n.of("round_done")) for n in nodes}
    with SwarmObserver([a.maddrs[0]]) as observer:
        deadline = time.monotonic() + MERGE_S
        while True:
            peers = observed_heartbeats(observer)
            digests = {h.applied_digest for h in peers}
            counts = [h.num_applied for h in peers]
            if len(peers) == 3 and len(digests) == 1 and counts == [sum(published.values())] * 3:
                break
            assert time.monotonic() < deadline, f"replicas did not converge: {peers}"
            time.sleep(1.0)
    assert all(h.num_lost == 0 for h in peers)


STRAGGLER_WINDOW_S = 8.0
"""How long the straggler is paused (its peer's merges during it are counted), and the window
before it its own on-time updates are taken from."""


def straggler_delays_nobody(a: NodeProcess, b: NodeProcess, c: NodeProcess) -> None:
    """While `c` is paused, `a` merges `b`'s updates at the rate it did before; `c`'s late
    updates, merged once it is back, are staler and weigh less than its earlier ones."""
    window_s = STRAGGLER_WINDOW_S
    first = wait_merged(a, b.peer_id)
    wait_merged(a, c.peer_id)
    # Measure A's merge rate of B's updates before and during C's pause.
    time.sleep(max(0.0, first["time"] + window_s + 2 - time.time()))
    paused_at = time.time()
    # c's on-time updates: those of the window before its pause (alone, this was a swarm of
    # ~10 s, all of c's updates; here earlier ones span start-up and realignments)
    before = [e for e in merged_from(a, c.peer_id) if e["time"] >= paused_at - window_s]
    assert before, "c's updates merged in the window before its pause"
    c.pause()
    try:
        time.sleep(window_s)  # the pause itself is the fault under test
    finally:
        c.resume()
    # The rate before is taken over everything since b's first merge (at least window_s + 2 s):
    # one window of 8 s held 1 or 3 of b's ~4.5 s rounds by phase alone (session 29's failure
    # got (1, 4)), so a count in one window before said more about phase than about rate.
    from_b = [e["time"] for e in merged_from(a, b.peer_id)]
    span_s = paused_at - first["time"]
    num_before = sum(first["time"] <= t < paused_at for t in from_b)
    num_during = sum(paused_at <= t < paused_at + window_s for t in from_b)
    expected = num_before / span_s * window_s
    assert num_before >= 2 and num_during >= 0.5 * expected, (num_before, span_s, num_during)

    late = [wait_merged(a, c.peer_id, after_seq=before[-1]["seq"])]
    late.append(wait_merged(a, c.peer_id, after_seq=late[0]["seq"]))
    assert max(e["staleness"] for e in late) > max(e["staleness"] for e in before)
    assert min(e["weight"] for e in late) < min(e["weight"] for e in before)


@pytest.mark.beside  # bounded waits, no timing window: on the other worker (conftest)
@pytest.mark.timeout(covering(3 * START_S, FORGER_S, 2 * MERGE_S))
def test_a_forged_update_is_rejected_and_counted_and_another_config_is_refused_clearly(
    launch: Launch, tmp_path: Path
) -> None:
    """One node, two intruders at once (sharing the victim's start-up): a peer whose update
    was changed after signing, and a node whose model config differs."""
    run = [*RUN, "--run-id", "their-run"]
    victim = launch(*run, name="victim")
    maddr = victim.wait_listening(START_S)[0]
    victim.wait_for_event("round_done", START_S)
    # The odd node starts now, beside the forger: its start-up and refusal overlap the forger's
    # (it is refused at the run check, before it publishes or fetches anything).
    other = launch(*RUN, "--seed", "7", "--peers", maddr, name="odd")  # no --run-id
    forger = subprocess.run(
        [sys.executable, "-m", "tests.swarm.forger", maddr, str(tmp_path / "forger"), *run],
        cwd=REPO, capture_output=True, text=True, timeout=FORGER_S,
        env={**os.environ, "HOME": str(tmp_path / "forger")},
    )  # fmt: skip
    assert forger.returncode == 0, forger.stderr[-3000:]
    rejected = victim.wait_for(
        lambda e: e.get("event") == "update_rejected" and e["reason"] == "bad_signature",
        MERGE_S,
        "the forged update being rejected",
    )
    assert rejected["author"] == forger.stdout.strip()
    rounds_then = len(victim.of("round_done"))
    victim.wait_for(
        lambda e: e.get("event") == "round_done" and e["round"] > rounds_then + 1,
        MERGE_S,
        "training to go on",
    )
    assert not [e for e in victim.of("update_merged") if e["author"] == rejected["author"]]

    assert other.wait_exit(START_S) != 0
    error = other.stderr_tail()
    # The run its peer trains, with that run's settings (not diloco-default beside it) ...
    assert "the swarm trains one run, 'their-run' (" in error
    # ... and the flag given on the command line, which wins, named as the difference.
    assert "run 'their-run' in this swarm uses a different model or run configuration" in error
    assert "seed: swarm 0, yours 7" in error  # each differing setting named, not two dicts
    assert "Traceback" not in error


@pytest.mark.beside  # bounded waits, no timing window: on the other worker (conftest)
@pytest.mark.timeout(covering(HIVEMIND_DHT_S, 2 * START_S, 2 * MERGE_S, EXIT_S))
def test_a_plain_hivemind_dht_peer_can_bootstrap_the_swarm(launch: Launch) -> None:
    dht = subprocess.Popen(
        ["hivemind-dht", "--host_maddrs", "/ip4/127.0.0.1/tcp/0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        maddr = _bootstrap_maddr(dht)
        a = launch(*RUN, "--peers", maddr, name="a")
        b = launch(*RUN, "--peers", maddr, name="b")
        a.wait_listening(START_S)
        b.wait_listening(START_S)
        wait_merged(a, b.peer_id)
        wait_merged(b, a.peer_id)
    finally:
        os.killpg(dht.pid, 9)
        dht.wait(timeout=EXIT_S)


def _bootstrap_maddr(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + HIVEMIND_DHT_S
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        found = re.search(r"--initial_peers (\S+)", line)
        if found:
            return found.group(1)
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"hivemind-dht did not print its address within {HIVEMIND_DHT_S} s")


@pytest.mark.timeout(covering(3 * START_S, 3 * MERGE_S, 2 * EXIT_S))
def test_a_finished_node_lingers_serving_and_merging_before_it_leaves(launch: Launch) -> None:
    # Long enough for the stayer to start, join and finish a round on a loaded machine: its
    # first update was merged 6 s into the linger at load 6 (session 17): 3x that.
    linger_s = 20
    a = launch(*RUN, "--max-rounds", "2", "--linger", str(linger_s), name="finisher")
    b = launch(*RUN, "--peers", a.wait_listening(START_S)[0], name="stayer")
    b.wait_listening(START_S)
    lingering = a.wait_for_event("lingering", START_S)
    stopped = a.wait_for_event("stopped", MERGE_S)
    assert stopped["reason"] == "max_rounds" and stopped["time"] - lingering["time"] >= linger_s
    assert a.wait_exit(2 * EXIT_S) == 0
    merged_while_lingering = [
        e for e in merged_from(a, b.peer_id) if lingering["time"] < e["time"] < stopped["time"]
    ]
    assert merged_while_lingering, "a lingering node keeps merging its peers' updates"
    # The finisher's last update reached the stayer: merged, or in the replica it downloaded.
    last_seq = stopped["seq"]
    downloaded = b.of("state_downloaded")
    # (before the stayer's first update, the finisher's are the only ones in the swarm)
    if not (downloaded and downloaded[0]["num_applied"] >= last_seq):
        wait_merged(b, a.peer_id, after_seq=last_seq - 1)
