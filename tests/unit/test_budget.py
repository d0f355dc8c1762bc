"""Per-peer budgets: a flooder runs out, others do not notice, memory stays bounded."""

from __future__ import annotations

from dht.budget import PeerBudget


def test_a_flood_spends_only_the_flooders_budget() -> None:
    budget = PeerBudget(rate_per_s=1.0, burst=3)
    assert [budget.allow("flooder", 0.0) for _ in range(5)] == [True, True, True, False, False]
    assert budget.allow("honest", 0.0)
    assert budget.allow("flooder", 1.0) and not budget.allow("flooder", 1.0)  # refilled one


def test_the_table_of_peers_stays_bounded() -> None:
    budget = PeerBudget(rate_per_s=1.0, burst=1, max_peers=100)
    for i in range(10_000):
        budget.allow(f"sybil-{i}", float(i))
    assert len(budget) == 100
    budget.forget("sybil-9999")
    assert len(budget) == 99
