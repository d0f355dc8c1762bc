"""Catch-up of a group update that no peer holds whole (docs/scale.md, Session 28): the
gossip's fetcher (dht/gossip_fetch.py, over the real UpdateServer on loopback TCP, as in
tests/unit/test_gossip_group_fetch.py) is refused the update whole by a peer that holds some
of its shards; with the exchange's `assemble` hooked in (node.network_swarm does), the
update is put together from its shards' holders (real `GroupExchange`s on the in-memory pipe
of tests/unit/test_fetch_round_sums.py), each shard checked, merged, and retained whole."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from dht.gossip_groups import group_update_id
from dht.group_exchange import GroupExchange
from dht.grouping_wire import encode_update
from dht.retention import RetainedUpdates
from merge.group_update import GroupUpdate
from merge.identity import Identity
from merge.shard_holders import ShardHolding, fields_of, held_shards
from tests.unit.test_fetch_round_sums import Loopback
from tests.unit.test_gossip_group_fetch import _closed, _fetching
from tests.unit.test_group_merge import IDS, NUMEL, RUN, _pipeline, _update


def _exchange(hub: Loopback, identity: Identity, live: tuple[str, ...] = ()) -> GroupExchange:
    network = hub.network(identity)
    network.config = SimpleNamespace(run_id=RUN)
    node = GroupExchange(
        network, numel=NUMEL, reject=lambda *_: None, is_alive=lambda _: True,
        shard_fetch=_pipeline().groups, live_peers=lambda: list(live),
    )  # fmt: skip
    node.fetch_wait_s = 2.0
    hub.nodes[identity.peer_id] = node
    return node


async def _catch_up(
    update: GroupUpdate, hooked: bool, bystander: bool = False
) -> dict[str, object]:
    """`bystander`: the peer repair names applied the update and holds none of it (any
    replica outside the group); the group's members are live peers of the asker."""
    hub = Loopback()
    bounds = update.shard_bounds(NUMEL)
    for author in IDS[:3]:
        node = _exchange(hub, author)
        mine = {k: update.aggregate[slice(*bounds[k])] for k in held_shards(update, author.peer_id)}
        node.keep_shards(
            group_update_id(update), ShardHolding.of_shards(fields_of(update), NUMEL, mine)
        )
    members = tuple(i.peer_id for i in IDS[:3])
    asker = _exchange(hub, Identity.generate(), members if bystander else ())
    refuser = IDS[0].peer_id  # holds shards, not the update whole
    if bystander:
        refuser = _exchange(hub, Identity.generate()).identity.peer_id  # holds nothing
    empty = RetainedUpdates(per_author=16, budget_bytes=1 << 20)
    pipeline = _pipeline()
    network, ctx, fetcher, merged = await _fetching({refuser: empty}, pipeline, lambda _: None)
    if hooked:
        fetcher.assemble = asker.assemble
    key, seq = group_update_id(update)
    ctx.catchup.summary(refuser, {key: [(seq, seq)]}, {key: [(seq, seq)]}, now=0.0)
    for fetch in ctx.catchup.next_fetches(1.0, {refuser}):
        await fetcher.fetch_and_merge(fetch)
    await _closed(network, ctx)
    return {"pipeline": pipeline, "retained": ctx.retained, "assembled": asker.num_assembled}


def test_a_group_update_refused_whole_is_caught_up_from_its_shards_holders() -> None:
    update = _update(IDS[:3])
    uid = group_update_id(update)
    end = asyncio.run(_catch_up(update, hooked=True))
    pipeline = end["pipeline"]
    assert isinstance(pipeline, type(_pipeline()))
    assert pipeline.replica.applied == {uid[0]: [uid[1]]}
    assert end["assembled"] == 1
    direct = _pipeline()
    assert direct.submit_group(update, lambda peer: True).accepted
    assert torch.equal(pipeline.replica.params, direct.replica.params)
    retained = end["retained"]
    assert isinstance(retained, RetainedUpdates)
    assert retained.get(uid) == encode_update(update)  # served whole from here on


def test_without_the_hook_nothing_is_caught_up() -> None:
    update = _update(IDS[:3])
    end = asyncio.run(_catch_up(update, hooked=False))
    pipeline = end["pipeline"]
    assert isinstance(pipeline, type(_pipeline()))
    assert pipeline.replica.applied == {} and end["assembled"] == 0


def test_a_bystander_named_by_repair_leaves_the_assembly_to_the_group_s_live_members() -> None:
    """Nobody announces a folded update whole (Session 29): repair may name a replica that
    applied it and holds none of it; the asker then asks the live peers inside the update's
    group, whose shards make it whole."""
    update = _update(IDS[:3])
    uid = group_update_id(update)
    end = asyncio.run(_catch_up(update, hooked=True, bystander=True))
    pipeline = end["pipeline"]
    assert isinstance(pipeline, type(_pipeline()))
    assert pipeline.replica.applied == {uid[0]: [uid[1]]} and end["assembled"] == 1
