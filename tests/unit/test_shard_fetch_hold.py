"""The gossip's side of the shard fetch (dht.group_exchange_candidates; docs/scale.md, Session 17):
another group's update waits for a fetch round only for a bounded time, never the node's own
group's, and every candidate goes to the whole fetch once the node runs no more rounds."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dht import group_exchange_candidates
from dht.catchup import CatchUp, CatchUpConfig
from dht.group_exchange import GroupExchange
from dht.grouping import member_check
from merge.identity import Identity
from tests.unit.catchup_sim import SimNode
from tests.unit.shard_round_paths import _pipeline


def test_a_held_back_update_is_not_fetched_until_released() -> None:
    catchup = CatchUp(CatchUpConfig(max_in_flight=4), "b", SimNode("b"))
    held = {("groups.0b1", 2)}
    catchup.held_back = lambda uid, sources: uid in held
    for seq in (1, 2):
        catchup.announced("groups.0b1", seq, None, 0.0, holder="a")
    assert [f.seq for f in catchup.next_fetches(0.0, {"a"})] == [1]
    held.clear()
    assert [f.seq for f in catchup.next_fetches(0.0, {"a"})] == [2]


def _exchange(offers: list[tuple[str, int, str]]) -> GroupExchange:
    network = SimpleNamespace(identity=Identity.generate(), config=SimpleNamespace(run_id="r"))
    return GroupExchange(
        network,  # type: ignore[arg-type]
        numel=8,
        reject=lambda *_: None,
        is_alive=lambda _: True,
        offer=lambda key, seq, holder, cause="": offers.append((key, seq, holder)),
        shard_fetch=_pipeline("delayed_nesterov").groups,
    )


def test_other_groups_updates_wait_for_a_fetch_round_own_groups_never() -> None:
    async def run() -> None:
        offers: list[tuple[str, int, str]] = []
        exchange = _exchange(offers)
        exchange.fetch_wait_s = 0.05
        exchange.own_key("groups.0b0")
        assert not exchange.held_back(("groups.0b0", 3))  # its own group's
        assert not exchange.held_back(("12D3KooWpeer", 3))  # not a group's
        assert exchange.held_back(("groups.0b1", 3))
        exchange.candidate("groups.0b1", 3, "holder")
        assert offers == []  # a candidate of the next fetch round
        await asyncio.sleep(4 * exchange.fetch_wait_s)  # FALLBACK_ROUNDS group waits
        assert offers == [("groups.0b1", 3, "holder")]
        assert not exchange.held_back(("groups.0b1", 3))  # handed over for good

    asyncio.run(run())


def test_a_node_that_runs_no_more_rounds_hands_every_candidate_over() -> None:
    async def run() -> None:
        offers: list[tuple[str, int, str]] = []
        exchange = _exchange(offers)
        exchange.candidate("groups.0b1", 3, "h1")
        exchange.candidate("groups.0b1", 3, "h2")
        exchange.stop_holding()
        assert offers == [("groups.0b1", 3, "h1"), ("groups.0b1", 3, "h2")]
        exchange.candidate("groups.0b1", 4, "h1")  # a later notice: at once
        assert offers[-1] == ("groups.0b1", 4, "h1")
        assert not exchange.held_back(("groups.0b1", 5))

    asyncio.run(run())


def test_an_update_no_notice_named_is_held_one_group_wait_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Session 18: a group ahead whose notices are refused (too far) never makes candidates;
    its updates wait one group wait, not three, before the whole fetch. The exchange's clock
    is the test's: on a loaded machine a real sleep of 1.5 waits overran three (CI 38)."""
    now = [1000.0]
    monkeypatch.setattr(
        group_exchange_candidates, "time", SimpleNamespace(monotonic=lambda: now[0])
    )

    async def run() -> None:
        exchange = _exchange([])
        exchange.fetch_wait_s = 10.0
        exchange.candidate("groups.0b1", 3, "holder")
        assert exchange.held_back(("groups.0b1", 3)) and exchange.held_back(("groups.0b1", 4))
        now[0] += 1.5 * exchange.fetch_wait_s
        assert exchange.held_back(("groups.0b1", 3))  # a candidate: up to three waits
        assert not exchange.held_back(("groups.0b1", 4))  # no notice: one
        now[0] += 2 * exchange.fetch_wait_s
        assert not exchange.held_back(("groups.0b1", 3))

    asyncio.run(run())


def test_an_update_the_gossip_wants_becomes_a_candidate_with_its_groups_members_only() -> None:
    """Session 22: 77 notices refused as too far left ids no round could take; fetched whole
    after one wait, they reached members at moments of their own. Now the gossip's live
    sources of it that are members of its group (they kept it: they serve its slices) make
    it a candidate of the next round; a source outside the group is no holder of a slice."""

    async def run() -> None:
        exchange = _exchange([])
        exchange.fetch_wait_s = 10.0
        inside = member_check("r", "groups.0b1")
        peers = [f"12D3KooWpeer{i}" for i in range(64)]
        member = next(p for p in peers if inside(p))
        outsider = next(p for p in peers if not inside(p))
        assert exchange.held_back(("groups.0b1", 7), [outsider])  # held, no candidate
        assert ("groups.0b1", 7) not in exchange._candidates
        assert exchange.held_back(("groups.0b1", 7), [outsider, member])
        assert exchange._candidates[("groups.0b1", 7)] == (member,)

    asyncio.run(run())


def test_each_fetch_names_why_it_was_wanted() -> None:
    """The update_fetched event's `cause`: a header heard, a peer's summary, or the reason a
    caller named (the shard fetch's hand-over), the latest naming winning."""
    from dht.ranges import Ranges

    catchup = CatchUp(CatchUpConfig(max_in_flight=8), "b", SimNode("b"))
    catchup.announced("a", 1, None, 0.0)
    held: Ranges = {"a": [(2, 2)]}
    catchup.summary("c", held, held, 0.0)
    catchup.announced("groups.0b1", 4, None, 0.0, holder="c")
    catchup.announced("groups.0b1", 4, None, 0.0, holder="c", cause="handed_over_timer")
    causes = {(f.author, f.seq): f.cause for f in catchup.next_fetches(0.0, {"a", "c"})}
    assert causes == {
        ("a", 1): "announced",
        ("a", 2): "summary",
        ("groups.0b1", 4): "handed_over_timer",
    }
