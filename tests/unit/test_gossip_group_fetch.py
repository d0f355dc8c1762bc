"""A learner group's update fetched by catch-up from a holder (dht/gossip_fetch.py's group path):
over real loopback TCP streams served by the real UpdateServer from a holder's retained copy,
merged by a real pipeline, then retained and announced in the fetcher's holder record. A
holder serving a tampered copy under the id is counted and another holder is asked. The DHT
is a recorder of stores (reading them back through hivemind is tests/swarm's)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dht.catchup import CatchUp, CatchUpConfig
from dht.gossip_announce import Announcements
from dht.gossip_context import GossipContext
from dht.gossip_fetch import Fetcher
from dht.gossip_groups import group_update_id
from dht.gossip_serve import UpdateServer
from dht.grouping_wire import encode_update
from dht.messages import holder_subkey
from dht.rejections import Rejections
from dht.retention import RetainedUpdates
from dht.swarm_config import SwarmConfig
from merge.group_equivocation import GroupProof, GroupVariant
from merge.group_update import GroupUpdate
from merge.pipeline import UpdatePipeline
from merge.result import MergeResult
from tests.factories import FINGERPRINT
from tests.unit.test_group_merge import IDS, RUN, _pipeline, _update


class LoopbackNetwork:
    """Peers' `update` handlers on 127.0.0.1 TCP servers (the real UpdateServer each); DHT
    stores recorded."""

    def __init__(self) -> None:
        self.config = SwarmConfig(
            run_id=RUN, fingerprint=FINGERPRINT, run_summary={}, identity_path=""
        )
        self.peer_id = "fetcher"
        self.ports: dict[str, int] = {}
        self.servers: list[asyncio.Server] = []
        self.stores: list[tuple[str, str, Any]] = []

    async def serve(self, peer_id: str, retained: RetainedUpdates) -> None:
        server = UpdateServer(retained)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await server.rpc_update(None, reader, writer)
            finally:
                writer.close()

        tcp = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.servers.append(tcp)
        self.ports[peer_id] = tcp.sockets[0].getsockname()[1]

    async def open_stream(self, peer_id: str, name: str) -> tuple[Any, Any]:
        assert name == "update"
        return await asyncio.open_connection("127.0.0.1", self.ports[peer_id])

    async def path_to(self, peer_id: str) -> str | None:
        return None

    def spawn(self, coro: Any) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(coro)

    async def dht_store(self, key: str, subkey: str, value: Any, ttl_s: float) -> None:
        self.stores.append((key, subkey, value))


def _holding(update: GroupUpdate, blob: bytes | None = None) -> RetainedUpdates:
    retained = RetainedUpdates(per_author=16, budget_bytes=1 << 24)
    retained.put(group_update_id(update), encode_update(update) if blob is None else blob)
    return retained


async def _fetching(
    holders: dict[str, RetainedUpdates],
    pipeline: UpdatePipeline,
    on_evidence: Callable[[Any], None],
) -> tuple[LoopbackNetwork, GossipContext, Fetcher, list[MergeResult]]:
    """A Fetcher merging into `pipeline` over loopback TCP from `holders` (each serving what
    it retains), with what it merged and rejected."""
    network = LoopbackNetwork()
    for peer_id, retained in holders.items():
        await network.serve(peer_id, retained)
    merged: list[MergeResult] = []
    ctx = GossipContext(
        network=network,  # type: ignore[arg-type]
        membership=None,  # type: ignore[arg-type]  # a fetch reads no heartbeats
        merge=pipeline,
        catchup=CatchUp(CatchUpConfig(retry_s=0.0), network.peer_id, pipeline.replica),
        retained=RetainedUpdates(per_author=16, budget_bytes=1 << 24),
        merge_pool=ThreadPoolExecutor(1),
        reject=Rejections(merged.append),
        on_merge=merged.append,
        on_event=lambda *a, **k: None,
        active=True,
    )
    announcements = Announcements(ctx, lambda header: None)

    async def retain_group(group: GroupUpdate, blob: bytes) -> None:
        await announcements.retain_blob(group_update_id(group), blob)

    fetcher = Fetcher(
        ctx, on_evidence=on_evidence, retain=announcements.retain, retain_group=retain_group
    )
    return network, ctx, fetcher, merged


async def _closed(network: LoopbackNetwork, ctx: GossipContext) -> None:
    await asyncio.sleep(0.05)  # the holder record's write (in the background)
    for server in network.servers:
        server.close()
    ctx.merge_pool.shutdown()  # type: ignore[attr-defined]


async def _catch_up(
    update: GroupUpdate,
    holders: dict[str, RetainedUpdates],
    pipeline: UpdatePipeline | None = None,
    applied_meanwhile: GroupUpdate | None = None,
) -> dict[str, Any]:
    """`applied_meanwhile`: a variant of the id merged (from a push) after catch-up wanted it."""
    pipeline = _pipeline() if pipeline is None else pipeline
    evidence: list[object] = []
    network, ctx, fetcher, merged = await _fetching(holders, pipeline, evidence.append)
    catchup = ctx.catchup
    key, seq = group_update_id(update)
    ranges = {key: [(seq, seq)]}
    for peer_id in holders:  # each holder's summary names it (applied and retained)
        catchup.summary(peer_id, ranges, ranges, now=0.0)
    alive, fetched_from = set(holders), []
    for _ in range(len(holders)):
        for fetch in catchup.next_fetches(1.0, alive):
            if applied_meanwhile is not None:
                assert pipeline.submit_group(applied_meanwhile, lambda peer: True).accepted
            fetched_from.append(fetch.peer_id)
            await fetcher.fetch_and_merge(fetch)
    await _closed(network, ctx)
    return {
        "pipeline": pipeline,
        "merged": merged,
        "rejections": ctx.reject.counts,
        "retained": ctx.retained,
        "stores": network.stores,
        "fetched_from": fetched_from,
        "wanted": catchup.num_wanted,
        "evidence": evidence,
    }


def test_a_missed_group_update_is_fetched_from_a_holder_merged_and_held_in_turn() -> None:
    update = _update(IDS[:3])
    end = asyncio.run(_catch_up(update, {"holder": _holding(update)}))
    uid = group_update_id(update)
    assert end["fetched_from"] == ["holder"] and end["wanted"] == 0
    assert end["pipeline"].replica.applied == {uid[0]: [uid[1]]}
    assert [r.accepted for r in end["merged"]] == [True]
    assert end["retained"].get(uid) == encode_update(update)  # served here from now on
    prefix = LoopbackNetwork().config.prefix
    assert (f"{prefix}/holders/{uid[0]}", holder_subkey("fetcher")) in [
        store[:2] for store in end["stores"]
    ]
    direct = _pipeline()  # the same as a replica that merged it from the push
    assert direct.submit_group(update, lambda peer: True).accepted
    assert torch.equal(end["pipeline"].replica.params, direct.replica.params)


def test_a_tampered_copy_is_counted_against_its_holder_and_another_holder_asked() -> None:
    update = _update(IDS[:3])
    tampered = GroupUpdate(
        update.contributions, update.shard_digests, update.cosignatures, update.aggregate * 5
    )
    holders = {"a-liar": _holding(update, encode_update(tampered)), "b-honest": _holding(update)}
    end = asyncio.run(_catch_up(update, holders))
    assert end["fetched_from"] == ["a-liar", "b-honest"]
    assert end["rejections"]["served_bad_group_update"] == 1
    assert end["pipeline"].replica.applied == {update.head.group_key: [update.seq]}
    assert end["retained"].get(group_update_id(update)) == encode_update(update)


def test_a_fetched_second_variant_becomes_a_proof_not_a_lie_of_its_holder() -> None:
    """A valid variant of an id this replica applied another variant of meanwhile: the proof
    the two make is passed on (dht.gossip_evidence), the holder is not counted, the id is
    not asked of anyone else."""
    first, second = _update(IDS[:3]), _update(IDS[:2])
    pipeline = _pipeline()
    pipeline.enable_groups(RUN, lambda key: lambda peer: True)
    holders = {"a-holder": _holding(second), "b-holder": _holding(second)}
    end = asyncio.run(_catch_up(second, holders, pipeline, applied_meanwhile=first))
    assert end["fetched_from"] == ["a-holder"] and end["wanted"] == 0
    assert not end["rejections"]
    [proof] = end["evidence"]
    assert isinstance(proof, GroupProof) and proof.update_id == group_update_id(first)


def test_the_prevailing_variant_is_fetched_where_a_proof_withdrew_the_lesser_one() -> None:
    """A replica applied a member's lone variant, then the pair's proof withdrew it: catch-up
    wants nothing (the id stays applied), so the fetcher asks the proof's sender and the
    others in turn (`fetch_awaited`). A peer serving the lesser variant (it applied that one
    first) is passed over uncounted; the prevailing variant steps in the lesser's slot, and
    the replica ends as one that merged the prevailing variant alone."""
    kept, lesser = _update(IDS[:3]), _update([IDS[0]], scale=40.0)
    pipeline, alone = _pipeline(), _pipeline()
    for replica in (pipeline, alone):
        replica.enable_groups(RUN, lambda key: lambda peer: True)
    assert pipeline.submit_group(lesser, lambda peer: True).accepted
    assert alone.submit_group(kept, lambda peer: True).accepted
    run = pipeline.group_run
    assert run is not None
    head = kept.head
    proof = GroupProof.of(
        RUN, head.group_key, head.round, GroupVariant.of(kept), GroupVariant.of(lesser), run
    )
    uid = group_update_id(kept)
    assert pipeline.learn_group_proof(proof, lambda u: lesser if u == uid else None) == "withdraw"
    assert pipeline.equivocation.awaiting() == [uid]
    holders = {"a-lesser": _holding(lesser), "b-kept": _holding(kept)}
    end = asyncio.run(_awaited(uid, holders, pipeline))
    assert end["found"] and not end["rejections"]
    assert [r.accepted for r in end["merged"]] == [True]
    assert pipeline.equivocation.awaiting() == []
    torch.testing.assert_close(pipeline.replica.params, alone.replica.params)
    assert pipeline.replica.applied == alone.replica.applied
    again = asyncio.run(_awaited(uid, holders, pipeline))  # once: a duplicate now
    assert not again["found"] and not again["merged"]


async def _awaited(
    uid: tuple[str, int], holders: dict[str, RetainedUpdates], pipeline: UpdatePipeline
) -> dict[str, Any]:
    network, ctx, fetcher, merged = await _fetching(holders, pipeline, lambda proof: None)
    found = await fetcher.fetch_awaited(uid, sorted(holders))
    await _closed(network, ctx)
    return {"found": found, "merged": merged, "rejections": ctx.reject.counts}


def _proof_first() -> tuple[UpdatePipeline, GroupUpdate, GroupUpdate]:
    """A replica that learned the pair's proof (a member's lone variant against the honest
    round) and applied neither variant."""
    kept, lesser = _update(IDS[:3]), _update([IDS[0]], scale=40.0)
    pipeline = _pipeline()
    pipeline.enable_groups(RUN, lambda key: lambda peer: True)
    run = pipeline.group_run
    assert run is not None
    head = kept.head
    proof = GroupProof.of(
        RUN, head.group_key, head.round, GroupVariant.of(kept), GroupVariant.of(lesser), run
    )
    assert pipeline.learn_group_proof(proof, lambda uid: None) == "keep"
    return pipeline, kept, lesser


def test_a_replica_that_knows_the_proof_asks_another_holder_for_the_prevailing_variant() -> None:
    """The first holder serves the lesser variant (it applied that one first): the merge
    refuses it, the holder is not counted, and catch-up asks the next holder instead of
    settling the id; the prevailing variant is merged from it. Before, the id was settled
    as fetched on the first holder and the replica never took the round's step."""
    pipeline, kept, lesser = _proof_first()
    holders = {"a-lesser": _holding(lesser), "b-kept": _holding(kept)}
    end = asyncio.run(_catch_up(kept, holders, pipeline))
    assert end["fetched_from"] == ["a-lesser", "b-kept"] and end["wanted"] == 0
    assert not end["rejections"] and not end["evidence"]
    assert pipeline.replica.applied == {kept.head.group_key: [kept.seq]}
    alone = _pipeline()
    assert alone.submit_group(kept, lambda peer: True).accepted
    torch.testing.assert_close(pipeline.replica.params, alone.replica.params)
    assert end["retained"].get(group_update_id(kept)) == encode_update(kept)


def test_holders_that_all_serve_the_lesser_variant_never_settle_the_round_on_it() -> None:
    """Every holder serves the lesser variant: each is asked once, none counted, the id is
    never applied with it (still wanted, sourceless: catch-up's lost rule decides)."""
    pipeline, kept, lesser = _proof_first()
    holders = {f"{c}-lesser": _holding(lesser) for c in "abc"}
    end = asyncio.run(_catch_up(kept, holders, pipeline))
    assert end["fetched_from"] == ["a-lesser", "b-lesser", "c-lesser"]
    assert not end["rejections"] and not pipeline.replica.has_applied(*group_update_id(kept))
    assert end["wanted"] == 1
