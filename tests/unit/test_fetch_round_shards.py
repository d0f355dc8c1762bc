"""A fetch round over an update nobody holds whole, through the real exchange code
(docs/scale.md, Session 28: what the own update folded into its members' fetch round needs).
Three members run `_fetch_round` as in tests/unit/test_fetch_round_sums.py (real
`GroupExchange`s on real pipelines, the stream an in-memory pipe); the candidate is a group
update of three shards held only as shards:

- by the members themselves, member i holding shard i, which on the chunk grid is exactly its
  slice (the fold: a reducer's shard is its slice): each takes its slice from what it holds,
  nothing is asked of anyone for that update, nothing fetched whole;
- by the update's own reducers (reducer, then the next included member: merge.shard_holders),
  one of them named as the holder (an outsider's round after a folded round): a member whose
  slice the named holder does not hold gets it from the shard's holders, without the
  update's fields again.

Either way every member applies the round, the members end bit for bit alike and where
applying the updates one by one ends (`_assert_alike`)."""

from __future__ import annotations

import asyncio

import torch

from dht.group_exchange import GroupExchange
from dht.shard_fetch_slices import BARE_SLICE_MAGIC
from dht.transport import HEADER
from merge.group_update import GroupUpdate
from merge.shard_fetch import member_slice
from merge.shard_holders import ShardHolding, fields_of, held_shards
from tests.unit.shard_round_paths import NUMEL, _assert_alike, _pipeline
from tests.unit.test_fetch_round_sums import (
    MEMBERS,
    ONE,
    OWN_UPDATE,
    Loopback,
    Member,
    _ground,
    _reference,
    _update,
)

AUTHORS = sorted(_ground("0001", 3), key=lambda i: i.peer_id)
SHARDED = _update(ONE, AUTHORS, 0)
"""Group ONE's update of three shards, reduced by three members."""
IDS = sorted(m.peer_id for m in MEMBERS)


class Hub(Loopback):
    """Loopback that records the magic of every `group-slice` answer, by server."""

    def __init__(self) -> None:
        super().__init__()
        self.answers: list[tuple[str, bytes]] = []

    async def deliver(self, sender: str, peer: str, name: str, blob: bytes) -> bytes:
        answer = await super().deliver(sender, peer, name, blob)
        if name == "group-slice" and len(answer) > HEADER.size:
            self.answers.append((peer, answer[HEADER.size : HEADER.size + 4]))
        return answer


def _shards(update: GroupUpdate, which: list[int]) -> ShardHolding:
    bounds = update.shard_bounds(NUMEL)
    held = {k: update.aggregate[slice(*bounds[k])] for k in which}
    return ShardHolding.of_shards(fields_of(update), NUMEL, held)


def _round(by_members: bool) -> tuple[list[Member], Hub]:
    hub = Hub()

    async def run() -> list[Member]:
        members = [Member(hub, identity, OWN_UPDATE) for identity in MEMBERS]
        uid = (ONE, SHARDED.seq)
        if by_members:
            for member in members:
                rank = IDS.index(member.exchange.identity.peer_id)
                member.exchange.keep_shards(uid, _shards(SHARDED, [rank]))
            holders = IDS
        else:
            for author in AUTHORS:
                node = GroupExchange(
                    hub.network(author), numel=NUMEL, reject=lambda *_: None,
                    is_alive=lambda _: True, shard_fetch=_pipeline("delayed_nesterov").groups,
                )  # fmt: skip
                hub.nodes[author.peer_id] = node
                mine = list(held_shards(SHARDED, author.peer_id))
                node.keep_shards(uid, _shards(SHARDED, mine))
            holders = [AUTHORS[0].peer_id]
        for member in members:
            for holder in holders:
                member.exchange.candidate(ONE, SHARDED.seq, holder)
        await asyncio.wait_for(
            asyncio.gather(*(m.exchange._fetch_round(OWN_UPDATE, IDS) for m in members)), 30.0
        )
        return members

    return asyncio.run(run()), hub


def test_each_member_s_slice_of_a_folded_update_is_the_shard_it_holds() -> None:
    assert [member_slice(NUMEL, IDS, m) for m in IDS] == SHARDED.shard_bounds(NUMEL)
    members, hub = _round(by_members=True)
    for member in members:
        (event,) = [e for e in member.events if e["event"] == "shard_round"]
        assert event["outcome"] == "applied", event
        assert event["ids"] == event["applied"] == 1
        assert member.whole == [] and member.rejections == []
        assert member.exchange.num_slices_held == 1
    assert hub.answers == []  # nobody asked anyone for a slice
    first = members[0].pipeline
    for other in members[1:]:
        assert torch.equal(other.pipeline.replica.params, first.replica.params)
    _assert_alike(_reference([SHARDED]), first)


def test_an_outsider_s_slices_come_from_the_shards_holders_without_the_fields_again() -> None:
    members, hub = _round(by_members=False)
    for member in members:
        (event,) = [e for e in member.events if e["event"] == "shard_round"]
        assert event["outcome"] == "applied", event
        assert member.whole == [] and member.rejections == []
    named = AUTHORS[0].peer_id
    not_named = [(p, m) for p, m in hub.answers if p != named]
    assert not_named and all(m == BARE_SLICE_MAGIC for _, m in not_named)
    first = members[0].pipeline
    for other in members[1:]:
        assert torch.equal(other.pipeline.replica.params, first.replica.params)
    _assert_alike(_reference([SHARDED]), first)
