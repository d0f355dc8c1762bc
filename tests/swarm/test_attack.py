"""A hostile participant (bench.adversary, speaking the real protocol) against two honest nodes.

One honest pair and one adversary that runs every attack class of the test in turn, in one
swarm: the one-shot classes, each counted by the honest nodes with its reason (their own
update_rejected events, and the counters in their signed heartbeats); then issue 20's patient
classes, whose messages reach the honest nodes; then a poisoned state, which a newcomer joining
refuses for an honest one. The honest nodes keep training throughout and end with the same
applied set.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.procs import ChildProcess, python_module
from dht.observer import SwarmObserver
from merge.identity import Identity
from node.signals import FINISH_SIGNAL
from tests.swarm.conftest import NodeProcess, observed_heartbeats
from tests.swarm.together import bootstrap_address, unused_port
from tests.timeouts import covering

pytestmark = pytest.mark.swarm
Launch = Callable[..., NodeProcess]
RUN = ["--model", "tiny", "--threads", "1", "--inner-steps", "5", "--eval-batches", "1",
       "--heartbeat-period", "1", "--gap-wait", "8", "--seed", "0"]  # fmt: skip
START_S = 120
FINISH_S = 90
"""An honest node asked to finish (SIGUSR1) ending its round and starting to linger."""
LINGER_S = 600
"""A cap: a lingering honest node is reaped once the test is done with it (no guessed time:
the honest nodes train until the adversary is done, however long its start takes)."""
ATTACK_S = 240
MAX_OPEN_FILES = 1024
ATTACKS = ["forged_header", "wrong_shape", "nan_inf", "norm_1000x", "against_direction",
           "equivocation", "far_future", "oversized", "notify_flood", "bad_heartbeats",
           "mixed_subkeys"]  # fmt: skip
EXPECTED = {
    "forged_header": {"notify_bad_signature"},
    "wrong_shape": {"wrong_size", "malformed", "unknown_codec"},
    "nan_inf": {"non_finite"},
    "against_direction": {"against_momentum"},
    "equivocation": {"equivocation"},
    "far_future": {"seq_too_far", "future_timestamp"},
    "oversized": {"malformed"},
    "bad_heartbeats": {"heartbeat_malformed", "heartbeat_wrong_peer", "dht_record_bad_signature"},
    "mixed_subkeys": {"dht_record_subkey"},
}
"""Reasons each class must be counted under, on the honest nodes together."""
PATIENT = ["zero_flood", "sideways", "sybil_learners", "summary_flood"]
"""Issue 20's classes, after the one-shot ones (whose reasons they would otherwise blur) and
before poisoned_state (the newcomer it needs would be a third node in their view); the summary
flood last of them: were its ids walked, it would keep the honest loops busy after it."""
PATIENT_S = 4
"""Seconds each patient class keeps on here (bench.attack keeps them on the whole run). Each
sends its first batch at once; 4 s is 16 zero updates (4 a second) where 4 must be seen, and
at least one round of the others (6 s each cost 8 s more, 2026-12-06)."""
PATIENT_ATTACKS_S = 120
"""The four patient classes, each PATIENT_S and a settle (~35 s in all)."""
PACED = ["--speed-factor", "2", "--emulated-step-s", "0.15"]
"""The honest nodes' inner steps last 0.3 s (~0.1 s of it compute on an idle 2-core machine):
the attack classes' own timers (settle, heartbeat reads, patient durations) pace the test, not
the honest rounds, and unpaced the two trained flat out on both cores the whole test, beside
the adversary's and the newcomer's work. No assertion counts honest rounds beyond "trained
during the attacks"; sideways publishes at once and then once per honest round."""
SYBILS = 48
"""The adversary's fake keys: the first 8 for bad_heartbeats, the last 40 for sybil_learners."""


def start_adversary(
    launch: Launch, home: Path, maddr: str, attacks: list[str], *extra: str
) -> ChildProcess:
    """Reaped with the nodes (a process of its that outlives it fails the test), its events
    kept beside theirs (DILOCO_TEST_EVENTS_DIR)."""
    argv = python_module(
        "bench.adversary", "--peers", maddr, "--home", str(home), "--attacks", ",".join(attacks),
        "--settle", "2", "--min-applied", "4", *extra, "--", *RUN,
    )  # fmt: skip
    return launch.child(ChildProcess("adversary", argv, home=home))  # type: ignore[attr-defined]


@pytest.mark.timeout(
    covering(3 * START_S, ATTACK_S, PATIENT_ATTACKS_S, 2 * START_S, ATTACK_S, 2 * FINISH_S, 60)
)
def test_honest_nodes_count_each_attack_keep_training_and_agree(
    launch: Launch, tmp_path: Path
) -> None:
    """Every one-shot class in turn, counted with its reason; then the patient classes, whose
    messages reach the honest nodes; then poisoned_state: the
    adversary claims a thousand updates more than anyone, a second key of its own reports the
    same progress, applied set and the poisoned state's sketch (so, unless the honest donors
    echo each other, whose track records rank them first, the newcomer asks the adversary
    first and the same-applied-set check passes), and it serves its replica noised by the
    params' own norm: the newcomer refuses it if asked (far from both honest replicas, which
    weigh by track record; the accomplice has none) and loads an honest donor's state. The
    honest nodes train throughout and end with the same applied set."""
    # No --max-time: they train until the adversary is done, then are asked to finish.
    honest_args = [*RUN, *PACED, "--linger", str(LINGER_S)]
    # All three start at once (tests/swarm/together.py): honest0's address is known before it
    # listens, and the others dial it with the product's backoff until it does; the adversary
    # waits for both honest nodes, each with 4 updates applied.
    key, port = tmp_path / "honest0.key", unused_port()
    Identity.generate().save(key)
    maddr = bootstrap_address(str(key), port)
    a = launch(*honest_args, "--identity", str(key), "--port", str(port), name="honest0")
    b = launch(*honest_args, "--peers", maddr, name="honest1")
    classes = [*ATTACKS, *PATIENT, "poisoned_state"]
    adversary = start_adversary(
        launch, tmp_path / "adversary", maddr, classes, "--sybils", str(SYBILS), "--duration",
        str(PATIENT_S),
    )  # fmt: skip
    assert maddr in a.wait_listening(START_S), "honest0 listens where the others were sent"
    b.wait_listening(START_S)
    ready = adversary.wait_event("ready", START_S)
    mallory = ready["peer_id"]
    # the one-shot and the patient classes are over
    adversary.wait_event("poison_ready", ATTACK_S + PATIENT_ATTACKS_S)
    newcomer = launch(*RUN, "--peers", maddr, "--max-rounds", "3", name="newcomer")
    loaded = newcomer.wait_event("state_downloaded", START_S)
    assert loaded["peer_id"] in (a.peer_id, b.peer_id), "the newcomer loaded no honest state"
    refused = {e["author"] for e in newcomer.of("update_rejected") if e["reason"] == "bad_state"}
    # Asked first and refused, or ranked after the honest donors (dht.vouchers): either way
    # no honest donor was refused, and the poisoned state was not loaded (above).
    assert refused <= {mallory}, refused
    newcomer.wait_event("round_done", START_S)
    done = adversary.wait_event("done", ATTACK_S)
    attacks = {e["attack"]: e for e in adversary.of("attack")}
    assert list(attacks) == classes
    for name, event in attacks.items():
        assert event["error"] is None, (name, event["error"])
        # (the newcomer is in view by the end of poisoned_state)
        in_view = set(event["rounds"]) - {newcomer.peer_id}
        assert in_view == {a.peer_id, b.peer_id}, f"{name}: an honest node vanished"
    for name, reasons in EXPECTED.items():
        counted = set(attacks[name]["rejected"])
        assert reasons <= counted, f"{name}: counted {attacks[name]['rejected']}"
    flood = attacks["notify_flood"]["rejected"]
    assert flood.get("notify_rate", 0) + flood.get("notify_unknown_peer", 0) > 0, flood
    # Oversized notifies and payloads over the size cap are counted too (counted a little
    # later than the class that sent them: after the fetch gives up).
    counted = {reason for event in attacks.values() for reason in event["rejected"]}
    assert {"notify_too_large", "too_large"} <= counted, counted
    big = attacks["norm_1000x"]["rejected"]
    assert big.get("norm_too_large", 0) + big.get("norm_outlier", 0) > 0, big

    # The honest nodes' own logs name the adversary for every update they refused.
    for node in (a, b):
        by_reason = Counter(
            e["reason"] for e in node.of("update_rejected") if e["author"] == ready["peer_id"]
        )
        assert {"non_finite", "wrong_size", "seq_too_far", "future_timestamp"} <= set(by_reason)
        # The two variants of the equivocated id: each node proved it and settled it (the id
        # applied with no contribution), whichever variant it had applied first.
        proven = [e for e in node.of("equivocation_proven") if e["author"] == ready["peer_id"]]
        assert proven and {e["action"] for e in proven} <= {"withdraw", "record"}, proven
        bad = [e for e in node.of("update_rejected") if e["author"] in (a.peer_id, b.peer_id)]
        refusals = [line for line in node.stderr_tail(10_000).splitlines() if "rejected" in line]
        assert not bad, refusals

    # They kept training through the attacks, finished their rounds and agree on what they
    # applied (every honest update included: nothing censored).
    for node in (a, b):
        node.signal(FINISH_SIGNAL)
    for node in (a, b):
        during = [e for e in node.of("round_done") if ready["time"] <= e["time"] <= done["time"]]
        assert during, f"{node.name} did not train while attacked"
        node.wait_event("lingering", FINISH_S)
    published = {n.peer_id: max(e["seq"] or 0 for e in n.of("round_done")) for n in (a, b)}
    with SwarmObserver([maddr]) as observer:
        deadline = time.monotonic() + 60
        while True:
            peers = {h.peer_id: h for h in observed_heartbeats(observer) if h.peer_id in published}
            merged = {
                pid: {h.merged_by_author.get(author, 0) for author in published}
                for pid, h in peers.items()
            }
            if (
                len(peers) == 2
                and len({h.applied_digest for h in peers.values()}) == 1
                and all(
                    h.merged_by_author.get(author, 0) >= seq
                    for h in peers.values()
                    for author, seq in published.items()
                )
            ):
                break
            assert time.monotonic() < deadline, f"honest replicas disagree: {merged}"
            time.sleep(1)

    # Issue 20's adversaries speak the real protocol: what each patient class sent reached the
    # honest nodes (its updates merged or refused with a reason, its summaries learned or
    # refused), and they kept training through all of them without a traceback. What each
    # class costs (loss, RSS, a node's heartbeats missed while a summary of 2^20 ids is walked
    # on its loop) is bench.attack's to measure; the bounds are issue 20's, built and tested
    # where the defences live.
    honest = {a.peer_id, b.peer_id}
    for name in PATIENT:
        assert attacks[name]["sent"] > 0, name
        # the summary flood included (its ids are bounded before any work, so no loop stalls
        # and no node misses its heartbeats): both honest nodes stay in view
        assert set(attacks[name]["rounds"]) == honest, f"{name}: a node vanished"
    started = attacks[PATIENT[0]]["started_at"]
    for node in (a, b):
        assert seen(node, attacks["zero_flood"], lambda p: p == mallory) >= 4, node.name
        assert seen(node, attacks["sideways"], lambda p: p == mallory) >= 1, node.name
        sybils = seen(node, attacks["sybil_learners"], lambda p: p not in honest | {mallory})
        assert sybils >= 1, node.name
        repaired = [e for e in node.of("repair") if e["peer_id"] == mallory]
        by_node = attacks["summary_flood"]["by_node"].get(node.peer_id, {})
        assert repaired or any("summary" in r for r in by_node), f"{node.name}: summaries unheard"
        assert [e for e in node.of("round_done") if e["time"] >= started], node.name
        assert "Traceback" not in node.stderr_tail(400), node.stderr_tail(400)


def seen(node: ChildProcess, attack: dict[str, Any], authors: Callable[[str], bool]) -> int:
    """Updates of `authors` that `node` merged or refused while `attack` ran (or just after)."""
    return sum(
        authors(e["author"]) and attack["started_at"] <= e["time"] <= attack["ended_at"] + 5
        for e in node.of("update_merged") + node.of("update_rejected")
    )
