"""Mixed hardware on 127.0.0.1: a node emulating 3x slower hardware beside a full-speed one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from merge.identity import Identity
from merge.weighting import rounds_stale
from tests.swarm.conftest import NodeProcess
from tests.swarm.together import bootstrap_address, unused_port
from tests.timeouts import SLOW_MERGE_S, START_S, covering

pytestmark = pytest.mark.swarm
Launch = Callable[..., NodeProcess]
INNER_STEPS = 10
TOKENS_PER_STEP = 16 * 128  # the tiny preset's batch x block
RUN = ["--model", "tiny", "--threads", "1", "--inner-steps", str(INNER_STEPS), "--eval-batches",
       "2", "--heartbeat-period", "1"]  # fmt: skip
SIZING = {
    # Rounds last ~1.5 s of inner steps: the slow node fits fewer steps into one.
    "round_time": ["--round-time", "1.5"],
    # Rounds follow measured throughput: the slow node runs ~H/3 steps once it has measured
    # itself and the fast node's updates bear out the rate its heartbeats report.
    "dynamic_h": ["--dynamic-h"],
}
EVAL_S = 60


def wait_merged_count(node: NodeProcess, author: str, count: int) -> list[dict]:
    node.wait_for(
        lambda e: (
            e.get("event") == "update_merged"
            and e["author"] == author
            and sum(m["author"] == author for m in node.of("update_merged")) >= count
        ),
        SLOW_MERGE_S,
        f"{node.name} merging {count} updates of {author}",
    )
    return [e for e in node.of("update_merged") if e["author"] == author]


@pytest.mark.parametrize("sizing", SIZING)
@pytest.mark.timeout(covering(2 * START_S, 5 * SLOW_MERGE_S, EVAL_S))  # 3 rounds reported
def test_a_three_times_slower_node_keeps_contributing_at_its_own_pace(
    launch: Launch, tmp_path: Path, sizing: str
) -> None:
    run = [*RUN, *SIZING[sizing]]
    # Both start at once (tests/swarm/together.py): the fast node's address is known before
    # it listens, and the slow one dials it with the product's backoff until it does.
    key, port = tmp_path / "fast.key", unused_port()
    Identity.generate().save(key)
    maddr = bootstrap_address(str(key), port)
    fast = launch(*run, "--identity", str(key), "--port", str(port), name="fast")
    slow = launch(*run, "--speed-factor", "3", "--peers", maddr, name="slow")
    assert maddr in fast.wait_listening(START_S), "fast listens where slow was sent"
    slow.wait_listening(START_S)

    from_slow = wait_merged_count(fast, slow.peer_id, 3)
    # A peer counts as a learner once one of its updates is applied (dht.membership): the
    # fast node's updates published after it merged the slow one's are sized by two.
    seen = sum(m["author"] == fast.peer_id for m in slow.of("update_merged"))
    from_fast = wait_merged_count(slow, fast.peer_id, max(3, seen + 2))

    # Both keep contributing; once they see each other, updates are sized by two learners.
    assert {e["learners"] for e in from_slow[-2:] + from_fast[-2:]} == {2}
    # The weight follows the signed header: staleness (1+r)^-0.5, r the rounds of the swarm
    # the update missed, times tokens / (H x batch).
    tokens = {}
    for merged in from_slow:
        published = slow.wait_for(
            lambda e, seq=merged["seq"]: e.get("event") == "round_done" and e["seq"] == seq,
            SLOW_MERGE_S,
            f"slow reporting the round of seq {merged['seq']}",
        )
        tokens[merged["seq"]] = published["tokens"]
        rounds = rounds_stale(merged["staleness"], merged["learners"])
        expected = (1 + rounds) ** -0.5 * published["tokens"]
        assert merged["weight"] == pytest.approx(expected / (INNER_STEPS * TOKENS_PER_STEP), 1e-4)
    # The slow node fits fewer steps into a round (with --dynamic-h, once it has measured
    # itself), so its updates carry fewer tokens and weigh less than the fast node's would.
    fast_tokens = [e["tokens"] for e in fast.of("round_done") if e["seq"] is not None]
    assert tokens[from_slow[-1]["seq"]] < max(fast_tokens)
    if sizing == "dynamic_h":
        # The fast node runs H; the slow one plans fewer steps once it has seen the fast one.
        assert all(e["planned_steps"] == INNER_STEPS for e in fast.of("round_done"))
        assert slow.of("round_done")[-1]["planned_steps"] < INNER_STEPS
        assert fast.of("round_done")[-1]["steps_per_s"] > slow.of("round_done")[-1]["steps_per_s"]
    # ... and the swarm learns: both replicas, each with the other's updates merged in, beat the
    # untrained model the fast node started from. (The slow node may join from the fast one's
    # state, so its own first evaluation may be of an already trained replica: two evaluation
    # batches later it may read a little higher by noise alone.) The newest evaluation of
    # each: they run beside training.
    untrained = fast.wait_event("evaluated", EVAL_S)["val_loss"]
    assert fast.of("evaluated")[-1]["val_loss"] < untrained
    assert slow.of("evaluated")[-1]["val_loss"] < untrained
