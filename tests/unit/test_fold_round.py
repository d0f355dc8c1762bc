"""A learner group's round by reduce-scatter, then its members' fetch round, in one process
through the real exchange code (dht.group_exchange `run_sharded`, `_finish`, `_fetch_round`;
docs/scale.md, Session 29). Three members are real `GroupExchange`s on real pipelines; only
the libp2p streams are an in-memory pipe carrying the same framed bytes (`FoldHub`: the
`group-piece`, `group-shard`, `group-held` and `group-done` streams too).

- Today's round (no fold): every member gets every reduced shard's values, holds the update
  whole, applies it at once and then runs its fetch round over the other groups' updates.
- Folded (`fold=True`, --group-fold): each reduced shard's values go to its replica holder
  only and a seal (`DGS4`: digest and co-signature) to the other member; nobody holds the
  update whole; it is one more candidate of the members' fetch round, which applies it with
  the others'. Members end bit for bit alike and where applying the update whole and then the
  others one by one ends (`_assert_alike`).
- A member dropping mid-round, before or after its shards went out: the others complete the
  round without it or abandon it, and whatever they hold of it is applied by all of them or
  by none (never half-applied); their replicas end alike.
- A reducer whose values never reach the shard's replica holder sends no seal (session 30;
  stop 47's CI run: a member completed on the seal of a shard no live node held): no member
  completes the round with a shard nobody but its reducer holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dht.group_exchange import GroupExchange
from dht.grouping import member_check
from dht.grouping_shards import SEAL_MAGIC, SHARD_MAGIC
from dht.transport import HEADER, OK
from merge.group_shards import sharded_contribution
from merge.group_update import Abandoned, GroupUpdate, ReductionConfig, RoundFields
from merge.identity import Identity
from merge.pipeline import UpdatePipeline
from merge.shard_holders import folded
from tests.unit.shard_round_paths import (
    NUMEL,
    RUN,
    Spec,
    _assert_alike,
    _everyone,
    _pipeline,
    _tensor,
)
from tests.unit.shard_round_paths import _update as _path_update
from tests.unit.test_fetch_round_sums import (
    LEARNERS,
    MEMBERS,
    OTHERS,
    OWN,
    Loopback,
    _holders_keep,
    _reader,
    _retain,
    _Writer,
)

IDS = sorted(m.peer_id for m in MEMBERS)
WAIT_S, COSIGN_S = 0.6, 0.6


class FoldHub(Loopback):
    """Loopback with the group round's streams; `dead` peers neither send nor receive,
    `on_send` may kill a sender as it sends (`drop`)."""

    def __init__(self) -> None:
        super().__init__()
        self.dead: set[str] = set()
        self.shards: list[tuple[str, str, bytes]] = []
        """(sender, peer, magic) of each reduced shard delivered (`group-shard`, folded
        values on `group-held`)."""
        self.on_send: Callable[[str, str], None] = lambda sender, name: None
        self.lost: set[tuple[str, str]] = set()
        """(sender, stream) whose messages never arrive (the sender stays alive)."""

    async def deliver(self, sender: str, peer: str, name: str, blob: bytes) -> bytes:
        self.on_send(sender, name)
        if sender in self.dead or peer in self.dead or (sender, name) in self.lost:
            raise ConnectionError(f"{sender} -> {peer}: not reached")
        if name in ("group-fetch", "group-slice"):
            return await super().deliver(sender, peer, name, blob)
        node = self.nodes[peer]
        handler = {
            "group-piece": node.rpc_piece,
            "group-shard": node.rpc_shard,
            "group-held": node.rpc_held,
            "group-done": node.rpc_done,
        }[name]
        if name in ("group-shard", "group-held"):
            self.shards.append((sender, peer, blob[:4]))
        writer = _Writer()
        await handler(
            SimpleNamespace(peer_id=sender), _reader(HEADER.pack(OK, len(blob)) + blob), writer
        )
        return bytes(writer.data)


def _warm() -> UpdatePipeline:
    """Four updates of three learners (a Delayed Nesterov fold, then 1/3 of a round)."""
    pipeline = _pipeline("delayed_nesterov")
    for g in range(4):
        warm = _path_update(Spec(g, 0, "honest", 0, 0), 2, LEARNERS)
        assert pipeline.submit_group(warm, _everyone).accepted
    return pipeline


class Node:
    """One member: its pipeline, its exchange (emulating node.group_publishing: a whole
    outcome applied at once, a folded one left to the fetch round), what it counted."""

    def __init__(self, hub: FoldHub, identity: Identity, fold: bool) -> None:
        self.identity, self.pipeline = identity, _warm()
        self.rejections: list[tuple[str, str]] = []
        self.events: list[dict[str, Any]] = []
        self.exchange = GroupExchange(
            hub.network(identity), numel=NUMEL,
            reject=lambda reason, peer, detail: self.rejections.append((reason, peer)),
            is_alive=lambda peer: peer not in hub.dead, offer=lambda *a, **k: None,
            fetch=self._fetch, on_update=self._on_update, retain=_retain,
            shard_fetch=self.pipeline.groups,
            on_event=lambda name, **fields: self.events.append({"event": name, **fields}),
            fold=fold,
        )  # fmt: skip
        self.exchange.fetch_wait_s = 2.0
        hub.nodes[identity.peer_id] = self.exchange

    async def _fetch(self, peer: str, key: str, seq: int, cause: str = "") -> bytes | None:
        return None  # nobody serves an update whole here: a fallback assembles it

    def _on_update(self, update: GroupUpdate) -> bool:
        in_group = member_check(RUN, update.head.group_key)
        return self.pipeline.submit_group(update, in_group).accepted

    async def contribute(self, members: list[str]) -> GroupUpdate | Abandoned:
        fields = RoundFields(
            run_id=RUN, group_key=OWN, epoch=0, round=0, learners=LEARNERS,
            base_applied=4, published_applied=4,
        )  # fmt: skip
        rank = IDS.index(self.identity.peer_id)
        tensor = _tensor(Spec(rank, 0, "honest", 0, 0), 11)
        header, digests = sharded_contribution(tensor, self.identity, fields, 500, len(IDS))
        outcome = await self.exchange.run_sharded(
            header, digests, tensor, members, wait_s=WAIT_S, cosign_s=COSIGN_S,
            config=ReductionConfig(), codec="fp32",
        )  # fmt: skip
        if isinstance(outcome, GroupUpdate) and not folded(outcome, NUMEL):
            assert self.pipeline.submit_group(outcome, member_check(RUN, OWN)).accepted
        return outcome

    def rounds(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == "shard_round"]


async def _settled(nodes: list[Node], bound_s: float = 20.0) -> None:
    """Until every node's fetch round ended (its `shard_round` event: after any fallback)."""
    deadline = asyncio.get_running_loop().time() + bound_s
    while not all(n.rounds() for n in nodes):
        assert asyncio.get_running_loop().time() < deadline, "a fetch round still running"
        await asyncio.sleep(0.05)


def _run(fold: bool, others: list[GroupUpdate], drop: tuple[str, str] | None = None):
    """The three members' group round, then their fetch round over the own update (folded)
    and `others` (candidates from a holder that kept them); `drop`: (member, "before" or
    "after") its shards went out, or as its seal goes out ("seal": its values held by the
    shard's replica holder, session 30), it dies. The nodes, their outcomes, the hub."""
    hub = FoldHub()

    async def run() -> tuple[list[Node], list[Any]]:
        nodes = [Node(hub, identity, fold) for identity in MEMBERS]
        _holders_keep(hub, others, nodes)
        if drop is not None:
            victim, when = drop
            sent: list[str] = []

            def on_send(sender: str, name: str) -> None:
                if sender != victim or name not in ("group-shard", "group-held"):
                    return
                if when == "seal" and name == "group-shard":  # its values are held already
                    hub.dead.add(victim)
                if when == "before":
                    hub.dead.add(victim)
                sent.append(name)
                if when == "after" and len(sent) >= len(IDS) - 1:
                    asyncio.get_running_loop().call_soon(hub.dead.add, victim)

            hub.on_send = on_send
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(n.contribute(IDS) for n in nodes), return_exceptions=True), 30.0
        )
        if drop is not None:
            hub.dead.add(drop[0])
        await _settled([n for n in nodes if drop is None or n.identity.peer_id != drop[0]])
        return nodes, list(outcomes)

    nodes, outcomes = asyncio.run(run())
    return nodes, outcomes, hub


def _whole(nodes: list[Node], outcomes: list[Any]) -> GroupUpdate:
    """The round's update whole: from a member that holds it, or its members' shards."""
    for outcome in outcomes:
        if isinstance(outcome, GroupUpdate) and not folded(outcome, NUMEL):
            return outcome
    fields = next(o for o in outcomes if isinstance(o, GroupUpdate))
    shards: dict[int, torch.Tensor] = {}
    for node in nodes:
        holding = node.exchange._holdings.get((OWN, fields.seq))
        if holding is not None:
            shards.update(holding.shards)
    values = torch.cat([shards[k] for k in range(fields.num_shards)])
    return dataclasses.replace(fields, aggregate=values)


def _reference(own: GroupUpdate, others: list[GroupUpdate]) -> UpdatePipeline:
    pipeline = _warm()
    for update in sorted([own, *others], key=lambda u: (u.head.group_key, u.seq)):
        assert pipeline.submit_group(update, member_check(RUN, update.head.group_key)).accepted
    return pipeline


def _assert_one_state(nodes: list[Node]) -> None:
    first = nodes[0].pipeline
    for other in nodes[1:]:
        assert other.pipeline.replica.applied == first.replica.applied
        assert torch.equal(other.pipeline.replica.params, first.replica.params)


@pytest.mark.parametrize("fold", [False, True])
def test_a_round_then_its_fetch_round_ends_every_member_where_the_whole_update_does(
    fold: bool,
) -> None:
    others = sorted(OTHERS, key=lambda u: (u.head.group_key, u.seq))[:2]
    nodes, outcomes, hub = _run(fold, others)
    assert all(isinstance(o, GroupUpdate) for o in outcomes), outcomes
    assert all(folded(o, NUMEL) == fold for o in outcomes)
    own = _whole(nodes, outcomes)
    for node in nodes:
        (event,) = node.rounds()
        assert event["outcome"] == "applied", event
        assert event["ids"] == event["applied"] == len(others) + fold
        assert node.rejections == []
        assert node.pipeline.replica.has_applied(OWN, own.seq)
    magics = {m for _, _, m in hub.shards}
    assert magics == ({SHARD_MAGIC, SEAL_MAGIC} if fold else {SHARD_MAGIC})
    if fold:  # each shard's values to one member (its replica holder), a seal to the other
        values = [(s, p) for s, p, m in hub.shards if m == SHARD_MAGIC]
        assert len(values) == len(IDS) and len(hub.shards) == len(IDS) * (len(IDS) - 1)
        assert all(n.exchange.num_slices_held == 1 for n in nodes)
    _assert_one_state(nodes)
    _assert_alike(_reference(own, others), nodes[0].pipeline)


@pytest.mark.parametrize("rank", [0, 1, 2])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_member_dropping_mid_round_leaves_the_round_whole_or_gone_never_half_applied(
    when: str, rank: int
) -> None:
    victim = IDS[rank]
    others = sorted(OTHERS, key=lambda u: (u.head.group_key, u.seq))[:2]
    nodes, outcomes, _ = _run(True, others, (victim, when))
    live = [n for n in nodes if n.identity.peer_id != victim]
    live_outcomes = [o for n, o in zip(nodes, outcomes, strict=True) if n in live]
    kinds = {type(o) for o in live_outcomes}
    assert len(kinds) == 1, live_outcomes  # completed at both, or abandoned at both
    _assert_one_state(live)
    if isinstance(live_outcomes[0], GroupUpdate):
        own = _whole(live, live_outcomes)
        assert all(n.pipeline.replica.has_applied(OWN, own.seq) for n in live)
        for node in live:  # a round the dead member cannot answer in falls back: in order
            (event,) = node.rounds()
            assert event["outcome"] == "applied" or event["fallback_in_order"] >= 1, event
        taken = [u for u in others if live[0].pipeline.replica.has_applied(u.head.group_key, u.seq)]
        _assert_alike(_reference(own, taken), live[0].pipeline)
    else:
        assert not any(n.pipeline.replica.has_applied(OWN, 1) for n in live)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_reducer_dying_once_its_values_are_held_leaves_its_update_to_the_live(rank: int) -> None:
    """The reducer dies as its seal goes out, its values held by the shard's replica holder
    (session 30): one live member may complete on seals while the other, its seal missing,
    retries or adopts the first's update, taking the shards its own round had from itself.
    Whatever completed, the live members hold every shard of it between them (`_whole`), and
    a member that has not applied it yet puts it together from them (the gossip's hand-over:
    dht.group_exchange_assembly `assemble`); their replicas end alike. Stop 47's CI run lost
    such an update on every replica."""
    victim = IDS[rank]
    nodes, outcomes, _ = _run(True, [], (victim, "seal"))
    live = [n for n in nodes if n.identity.peer_id != victim]
    live_outcomes = [o for n, o in zip(nodes, outcomes, strict=True) if n in live]
    if not any(isinstance(o, GroupUpdate) for o in live_outcomes):
        assert not any(n.pipeline.replica.has_applied(OWN, 1) for n in live)
        return
    own = _whole(live, live_outcomes)  # every shard at a live member
    for node in live:
        if not node.pipeline.replica.has_applied(OWN, own.seq):
            got = asyncio.run(node.exchange.assemble((OWN, own.seq), IDS))
            assert isinstance(got, GroupUpdate) and torch.equal(got.aggregate, own.aggregate)
            assert node.pipeline.submit_group(got, member_check(RUN, OWN)).accepted
    _assert_one_state(live)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_a_reducer_whose_values_never_reach_their_holder_sends_no_seal(rank: int) -> None:
    """Its values lost on the way to the replica holder (the stream fails, the reducer lives
    on): before session 30 the third member completed on the shard's seal while the holder
    never had the values, and nobody could assemble the update. Now no seal goes out: every
    member ends the round alike (abandoned: the shard missing everywhere), nothing applied."""
    victim = IDS[rank]
    hub = FoldHub()
    hub.lost.add((victim, "group-held"))

    async def run() -> tuple[list[Node], list[Any]]:
        nodes = [Node(hub, identity, True) for identity in MEMBERS]
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(n.contribute(IDS) for n in nodes), return_exceptions=True), 30.0
        )
        return nodes, list(outcomes)

    nodes, outcomes = asyncio.run(run())
    assert all(isinstance(o, Abandoned) for o in outcomes), outcomes
    assert not any(m == SEAL_MAGIC for s, _, m in hub.shards if s == victim)
    assert not any(n.pipeline.replica.has_applied(OWN, 1) for n in nodes)
    _assert_one_state(nodes)
