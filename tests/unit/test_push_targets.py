"""Who a published header is pushed to (dht.gossip_context.push_targets): every peer that has
contributed, and a bounded number of peers that have not, so ~1,000 Sybil heartbeats cost a
publish a few streams while every honest learner still hears of each update at once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dht.gossip_context import MAX_PUSH_NEWCOMERS, push_targets

peers = st.lists(st.text("abcdef", min_size=1, max_size=4), unique=True, max_size=40)


@given(peers, st.sets(st.text("abcdef", min_size=1, max_size=4)), st.integers(0, 10))
def test_every_contributor_and_at_most_n_newcomers(
    alive: list[str], contributed: set[str], n: int
) -> None:
    targets = push_targets(alive, contributed.__contains__, n)
    assert len(targets) == len(set(targets)) and set(targets) <= set(alive)
    assert {p for p in alive if p in contributed} <= set(targets)
    newcomers = [p for p in targets if p not in contributed]
    assert newcomers == [p for p in alive if p not in contributed][:n]


def test_a_sybil_flood_costs_a_few_streams_not_a_thousand() -> None:
    honest = ["honest-a", "honest-b"]
    sybils = [f"sybil-{i}" for i in range(1000)]
    targets = push_targets(sybils[:500] + honest + sybils[500:], set(honest).__contains__)
    assert targets[:2] == honest and len(targets) == 2 + MAX_PUSH_NEWCOMERS


def test_a_newcomer_alone_is_pushed_to() -> None:
    assert push_targets(["fresh"], lambda p: False) == ["fresh"]
