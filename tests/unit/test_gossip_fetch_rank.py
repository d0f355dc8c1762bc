"""The fetcher's hooks into catch-up: sources ranked by this node's connection to each
(dht.reachability), authors judged fresh or established by the merge's ledger."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

from dht.catchup import CatchUp, CatchUpConfig
from dht.gossip_fetch import Fetcher
from dht.reachability import PathBook
from tests.unit.catchup_sim import SimNode


def _fetcher(network: object) -> tuple[Fetcher, CatchUp]:
    catchup = CatchUp(CatchUpConfig(), "b", SimNode("b"))
    ctx = SimpleNamespace(network=network, catchup=catchup)
    noop = lambda *a: None  # noqa: E731
    return Fetcher(ctx, on_evidence=noop, retain=noop, retain_group=noop), catchup  # type: ignore[arg-type]


def test_sources_are_ranked_by_the_path_p2pd_listed_last() -> None:
    paths = PathBook()
    paths.observe(
        {
            "home": ["/ip4/11.64.0.10/tcp/4100/p2p/relay/p2p-circuit"],
            "public": ["/ip4/11.64.0.10/tcp/4100"],
        }
    )
    fetcher, catchup = _fetcher(SimpleNamespace(paths=paths))
    assert catchup.source_rank == fetcher.source_rank
    assert [catchup.source_rank(p) for p in ("public", "home", "gone")] == [0, 1, 2]


def test_a_network_that_lists_no_paths_ranks_every_source_alike() -> None:
    _, catchup = _fetcher(SimpleNamespace())
    assert {catchup.source_rank(p) for p in ("a", "b")} == {0}


class _Ledger:
    """The merge port's freshness verdicts (a restarted node's ledger knows "a")."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def is_fresh_author(self, author: str) -> bool:
        self.asked.append(author)
        return author != "a"


def _judging_fetcher() -> tuple[Fetcher, _Ledger, list[int]]:
    ledger, kicks = _Ledger(), []
    network = SimpleNamespace(spawn=lambda coro: asyncio.get_running_loop().create_task(coro))

    async def off_loop(fn: Callable[..., object], *args: object) -> object:
        return fn(*args)

    ctx = SimpleNamespace(
        network=network,
        catchup=CatchUp(CatchUpConfig(), "b", SimNode("b")),
        merge=ledger,
        off_loop=off_loop,
        kick=lambda: kicks.append(1),
    )
    noop = lambda *a: None  # noqa: E731
    return Fetcher(ctx, on_evidence=noop, retain=noop, retain_group=noop), ledger, kicks  # type: ignore[arg-type]


def test_an_author_merged_nothing_of_yet_is_judged_by_the_ledger_once() -> None:
    """After a restart every author used to be fresh until one of its updates merged here."""

    async def scenario() -> None:
        fetcher, ledger, kicks = _judging_fetcher()
        assert fetcher.is_fresh("a") and fetcher.is_fresh("x")  # fresh until judged
        assert fetcher.is_fresh("a")  # asked once, not again while it is judged
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not fetcher.is_fresh("a") and fetcher.is_fresh("x")
        assert sorted(ledger.asked) == ["a", "x"] and kicks

    asyncio.run(scenario())


def test_a_merges_verdict_wins_over_a_judgement_that_comes_later() -> None:
    async def scenario() -> None:
        fetcher, _, _ = _judging_fetcher()
        assert fetcher.is_fresh("a")
        fetcher._judged("a", True)  # its update merged meanwhile: the merge said fresh
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert fetcher.is_fresh("a")

    asyncio.run(scenario())
