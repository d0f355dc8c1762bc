"""The fetcher ranks catch-up's sources by this node's connection to each (dht.reachability)."""

from __future__ import annotations

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
