"""Mixed hardware on 127.0.0.1: a node emulating 3x slower hardware beside a full-speed one."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.swarm.conftest import NodeProcess

pytestmark = pytest.mark.swarm
Launch = Callable[..., NodeProcess]
INNER_STEPS = 10
TOKENS_PER_STEP = 16 * 128  # the tiny preset's batch x block
# Rounds last ~1.5 s of inner steps (dynamic local updates): the slow node fits fewer steps.
RUN = ["--model", "tiny", "--threads", "1", "--inner-steps", str(INNER_STEPS), "--eval-batches",
       "2", "--heartbeat-period", "1", "--round-time", "1.5"]  # fmt: skip
START_S = 120
MERGE_S = 120


def wait_merged_count(node: NodeProcess, author: str, count: int) -> list[dict]:
    node.wait_for(
        lambda e: (
            e.get("event") == "update_merged"
            and e["author"] == author
            and sum(m["author"] == author for m in node.of("update_merged")) >= count
        ),
        MERGE_S,
        f"{node.name} merging {count} updates of {author}",
    )
    return [e for e in node.of("update_merged") if e["author"] == author]


def test_a_three_times_slower_node_keeps_contributing_at_its_own_pace(launch: Launch) -> None:
    fast = launch(*RUN, name="fast")
    slow = launch(*RUN, "--speed-factor", "3", "--peers", fast.wait_listening(START_S)[0],
                  name="slow")  # fmt: skip
    slow.wait_listening(START_S)

    from_slow = wait_merged_count(fast, slow.peer_id, 3)
    from_fast = wait_merged_count(slow, fast.peer_id, 3)

    # Both keep contributing; once they see each other, updates are sized by two learners.
    assert {e["learners"] for e in from_slow[-2:] + from_fast[-2:]} == {2}
    # The weight follows the signed header: staleness (1+s)^-0.5 times tokens / (H x batch).
    tokens = {}
    for merged in from_slow:
        published = slow.wait_for(
            lambda e, seq=merged["seq"]: e.get("event") == "round_done" and e["seq"] == seq,
            MERGE_S,
            f"slow reporting the round of seq {merged['seq']}",
        )
        tokens[merged["seq"]] = published["tokens"]
        expected = (1 + merged["staleness"]) ** -0.5 * published["tokens"]
        assert merged["weight"] == pytest.approx(expected / (INNER_STEPS * TOKENS_PER_STEP), 1e-4)
    # The slow node fits fewer steps into a round, so its updates carry fewer tokens and weigh
    # less than the fast node's updates at the same staleness would.
    fast_tokens = [e["tokens"] for e in fast.of("round_done") if e["seq"] is not None]
    assert max(tokens.values()) < max(fast_tokens)
    # ... and the swarm learns: the fast node's replica, slow updates merged in, improves.
    started = fast.of("started")[0]["val_loss"]
    assert fast.of("round_done")[-1]["val_loss"] < started
    assert slow.of("round_done")[-1]["val_loss"] < slow.of("started")[0]["val_loss"]
