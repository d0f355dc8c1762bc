"""Streaming fragments between real nodes: fragment updates gossiped and merged once, replicas
on one applied set, and a node killed mid-round losing only its unpublished fragment."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from dht.observer import SwarmObserver
from dht.state_check import applied_digest
from tests.swarm.conftest import NodeProcess, observed_heartbeats
from tests.timeouts import MERGE_S, START_S, covering

pytestmark = [pytest.mark.swarm, pytest.mark.beside]  # light: runs beside the swarm tests
Launch = Callable[..., NodeProcess]
RUN = ["--model", "tiny", "--threads", "1", "--inner-steps", "10", "--eval-batches", "1",
       "--heartbeat-period", "1", "--fragments", "2"]  # fmt: skip
SLOW_STEP_S = 0.6
"""a's paced inner step: 5 steps (3 s) between its fragment 0 and fragment 1 of a round."""


def merged(node: NodeProcess, author: str, seq: int) -> Callable[[dict], bool]:
    return lambda e: e.get("event") == "update_merged" and e["author"] == author and e["seq"] == seq


@pytest.mark.timeout(covering(2 * START_S, 5 * MERGE_S))
def test_two_nodes_exchange_fragments_and_a_killed_one_loses_only_the_unpublished(
    launch: Launch,
) -> None:
    # a trains slowly from genesis (every update it applies is in its events); b joins it.
    a = launch(*RUN, "--emulated-step-s", str(SLOW_STEP_S), name="a")
    b = launch(*RUN, "--max-rounds", "1", "--linger", "120", "--peers",
               a.wait_listening(START_S)[0], name="b")  # fmt: skip
    b.wait_event("lingering", START_S)  # b published fragment 0 after step 5, 1 after step 10
    assert [(e["step"], e["fragment"], e["seq"]) for e in b.of("fragment_published")] == [
        (5, 0, 1), (10, 1, 2),
    ]  # fmt: skip
    for seq in (1, 2):
        a.wait_for(merged(a, b.peer_id, seq), MERGE_S, f"a merging b's fragment update {seq}")

    # a's next fragment 0 reaches b; a dies before its fragment 1 of that round is due.
    latest = a.of("fragment_published")[-1]["round"]
    fragment_0 = a.wait_for(
        lambda e: e.get("event") == "fragment_published" and e["fragment"] == 0
        and e["round"] > latest,
        MERGE_S, "a publishing a fragment 0",
    )  # fmt: skip
    b.wait_for(merged(b, a.peer_id, fragment_0["seq"]), MERGE_S, "b merging a's fragment 0")
    a.crash()  # kill -9 of a, its DHT process and p2pd, mid-round
    published_a = [e for e in a.of("fragment_published") if e["seq"] is not None]
    assert published_a[-1] == fragment_0, "a published its fragment 1 before the kill"
    assert [e["fragment"] for e in published_a] == [p % 2 for p in range(len(published_a))]
    assert any(e["event"] == "update_merged" and e["author"] == a.peer_id for e in b.of())

    # b holds every fragment a published, and exactly a's applied set (a started at genesis).
    ids = [(e["author"], e["seq"]) for e in a.of("update_merged")]
    assert len(ids) == len(set(ids)) == len(published_a) + 2
    expected = {author: [s for x, s in ids if x == author] for author, _ in ids}
    with SwarmObserver([b.maddrs[0]]) as observer:
        deadline = time.monotonic() + MERGE_S
        while True:
            views = observed_heartbeats(observer)
            own = [h for h in views if h.peer_id == b.peer_id]
            if own and own[0].applied_digest == applied_digest(expected):
                break
            assert time.monotonic() < deadline, f"b's applied set is not a's: {own}"
            time.sleep(1.0)
    assert own[0].num_applied == len(ids)
    assert not [e for n in (a, b) for e in n.of("update_rejected")]
