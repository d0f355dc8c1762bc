"""Who counts as a learner when an update is sized: Sybil heartbeats do not."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dht.heartbeat import STATES, Heartbeat, count_learners
from merge.identity import Identity

IDS = [Identity.generate().peer_id for _ in range(6)]


def test_a_thousand_fresh_keys_with_heartbeats_add_no_learner() -> None:
    honest = [Heartbeat(peer_id=IDS[0]), Heartbeat(peer_id=IDS[1], state="idle")]
    sybils = [Heartbeat(peer_id=f"sybil{i}") for i in range(1000)]
    contributed = {IDS[0], IDS[1]}
    assert count_learners(honest + sybils, contributed.__contains__) == 1  # IDS[1] is idle


@given(st.lists(st.tuples(st.sampled_from(IDS), st.sampled_from(STATES), st.booleans())))
def test_learners_are_the_contributing_peers_that_are_not_idle(
    peers: list[tuple[str, str, bool]],
) -> None:
    alive = [Heartbeat(peer_id=p, state=s) for p, s, _ in peers]
    contributed = {p for p, _, c in peers if c}
    expected = sum(s != "idle" and p in contributed for p, s, _ in peers)
    assert count_learners(alive, contributed.__contains__) == expected
