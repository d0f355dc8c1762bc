"""A whole group update assembled from its shards' holders through the real exchange code
(dht.group_exchange_assembly, dht.group_exchange_slices `rpc_slice` from held shards;
docs/scale.md, Session 28): the holders are real `GroupExchange`s that keep only the shards
merge.shard_holders says they hold (reducer, then the next included member), the asker's whole
fetch finds no whole holder (`_whole`, a fetch round's fallback in order), and the libp2p
stream is the in-memory pipe of tests/unit/test_fetch_round_sums.py (`Loopback`)."""

from __future__ import annotations

import asyncio

import torch

from dht.group_exchange import GroupExchange
from dht.shard_fetch_slices import BARE_SLICE_MAGIC
from dht.transport import HEADER
from merge.group_update import GroupUpdate
from merge.identity import Identity
from merge.shard_holders import ShardHolding, fields_of, held_shards, shard_holders
from tests.unit.shard_round_paths import NUMEL, _pipeline
from tests.unit.test_fetch_round_sums import ONE, Loopback, _ground, _update

AUTHORS = sorted(_ground("0001", 3), key=lambda i: i.peer_id)
UPDATE = _update(ONE, AUTHORS, 0)
UID = (ONE, UPDATE.seq)


class Hub(Loopback):
    """Loopback whose dead peers are unreachable and whose `bad` peer flips one value of
    every slice it serves; every slice answer's magic is recorded."""

    def __init__(self, dead: set[str] = frozenset(), bad: str | None = None) -> None:
        super().__init__()
        self.dead, self.bad = set(dead), bad
        self.answers: list[tuple[str, bytes]] = []
        self.dead_asked = 0

    async def deliver(self, sender: str, peer: str, name: str, blob: bytes) -> bytes:
        if peer in self.dead:
            self.dead_asked += 1
            raise ConnectionError(f"{peer} is gone")
        answer = await super().deliver(sender, peer, name, blob)
        if name == "group-slice" and len(answer) > HEADER.size:
            self.answers.append((peer, answer[HEADER.size : HEADER.size + 4]))
            if peer == self.bad and len(answer) > 64:
                tampered = bytearray(answer)
                tampered[-1] ^= 0x40
                return bytes(tampered)
        return answer


def _node(hub: Hub, identity: Identity, rejections: list[tuple[str, str]]) -> GroupExchange:
    async def no_whole(*_: object, **__: object) -> bytes | None:
        return None  # nobody serves the update whole: only its shards are held

    node = GroupExchange(
        hub.network(identity), numel=NUMEL,
        reject=lambda reason, peer, detail: rejections.append((reason, peer)),
        is_alive=lambda _: True, fetch=no_whole, on_update=lambda _: True,
        shard_fetch=_pipeline("delayed_nesterov").groups,
    )  # fmt: skip
    node.fetch_wait_s = 2.0
    hub.nodes[identity.peer_id] = node
    return node


def _assemble(hub: Hub) -> tuple[GroupUpdate | None, GroupExchange, list[tuple[str, str]]]:
    rejections: list[tuple[str, str]] = []
    bounds = UPDATE.shard_bounds(NUMEL)
    for author in AUTHORS:
        node = _node(hub, author, [])
        mine = {k: UPDATE.aggregate[slice(*bounds[k])] for k in held_shards(UPDATE, author.peer_id)}
        node.keep_shards(UID, ShardHolding.of_shards(fields_of(UPDATE), NUMEL, mine))
    asker = _node(hub, Identity.generate(), rejections)
    holders = tuple(a.peer_id for a in AUTHORS)
    got = asyncio.run(asyncio.wait_for(asker._whole(UID, holders, "in_order_test"), 20.0))
    return got, asker, rejections


def test_no_whole_holder_the_update_is_assembled_from_its_shard_holders_bit_for_bit() -> None:
    hub = Hub()
    got, asker, rejections = _assemble(hub)
    assert isinstance(got, GroupUpdate)
    assert torch.equal(got.aggregate, UPDATE.aggregate)
    assert got.problem(lambda _: True) is None
    assert asker.num_assembled == 1 and rejections == []
    magics = [m for _, m in hub.answers]
    assert magics.count(b"DSS2") == 1  # the fields once, then every shard without them
    assert magics.count(BARE_SLICE_MAGIC) == UPDATE.num_shards


def test_a_dead_reducer_s_shard_comes_from_the_next_included_member() -> None:
    first = AUTHORS[0].peer_id
    hub = Hub(dead={first})
    got, asker, rejections = _assemble(hub)
    assert isinstance(got, GroupUpdate) and torch.equal(got.aggregate, UPDATE.aggregate)
    second = shard_holders(UPDATE, 0)[1]
    assert (second, BARE_SLICE_MAGIC) in hub.answers
    assert hub.dead_asked == 1  # not asked again for its shards once it did not answer


def test_a_holder_serving_a_wrong_value_is_counted_and_the_other_holder_serves_it() -> None:
    bad = AUTHORS[1].peer_id
    hub = Hub(bad=bad)
    got, _, rejections = _assemble(hub)
    assert isinstance(got, GroupUpdate) and torch.equal(got.aggregate, UPDATE.aggregate)
    assert rejections and all(peer == bad for _, peer in rejections)
    assert {reason for reason, _ in rejections} <= {
        "group_slice_chunk_mismatch",
        "group_slice_not_finite",
        "group_slice_wrong_size",
    }


def test_a_shard_whose_holders_are_all_gone_leaves_no_update() -> None:
    hub = Hub(dead=set(shard_holders(UPDATE, 1)))
    got, asker, _ = _assemble(hub)
    assert got is None and asker.num_assembled == 0
