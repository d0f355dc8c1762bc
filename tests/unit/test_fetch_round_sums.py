"""A fetch round whose set crosses Delayed Nesterov folds, through the real exchange code
(dht.group_exchange_fetch `_fetch_round`: proposals, slices from a holder's `rpc_slice`, parts,
sums through `rpc_fetch`, the apply; docs/scale.md, Session 27: second27). Three members of
one group and a holder are real `GroupExchange`s on real pipelines; only the libp2p stream
between them is an in-memory pipe carrying the same framed bytes (`Loopback`). Since session
27 a round with one fold gathers two sums and one with two folds three, and nothing is
fetched whole (sessions 18-26 cut at the first fold: one sum, and every member fetched the
updates past it whole, `in_order_deferred`). A member whose `sums` message carries another
number of sums than the round's plan is a counted rejection, never a crash."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from dht.group_exchange import GroupExchange
from dht.grouping import group_key, member_check, peer_bits
from dht.grouping_wire import GroupMessageError, encode_update
from dht.shard_fetch_wire import MAX_SUMS, FetchMessage, decode_fetch
from dht.transport import HEADER, OK, receive_blob
from merge.group_update import ContributionHeader, GroupReduction, GroupUpdate, RoundFields
from merge.identity import Identity
from merge.pipeline import UpdatePipeline
from tests.unit.shard_round_paths import (
    NUMEL,
    RUN,
    Spec,
    _assert_alike,
    _everyone,
    _pipeline,
    _tensor,
)
from tests.unit.shard_round_paths import (
    _update as _path_update,
)

OWN, ONE, TWO = group_key("0000"), group_key("0001"), group_key("0010")
LEARNERS = 3
"""Every update's claim: a Delayed Nesterov fold every three updates."""


def _ground(prefix: str, count: int) -> list[Identity]:
    """`count` identities whose position in RUN starts with `prefix` (members of its key)."""
    out: list[Identity] = []
    while len(out) < count:
        identity = Identity.generate()
        if peer_bits(RUN, identity.peer_id).startswith(prefix):
            out.append(identity)
    return out


MEMBERS = _ground("0000", 3)
AUTHORS = {ONE: _ground("0001", 1)[0], TWO: _ground("0010", 1)[0]}
HOLDERS = {ONE: Identity.generate(), TWO: Identity.generate()}
"""One holder a group (a holder keeps `MAX_KEPT_UPDATES` = 4 updates to serve)."""


def _update(key: str, members: list[Identity], round_: int) -> GroupUpdate:
    reduction = GroupReduction(
        group_key=key, epoch=0, round=round_, members=[m.peer_id for m in members]
    )
    fields = RoundFields(
        run_id=RUN, group_key=key, epoch=0, round=round_, learners=LEARNERS,
        base_applied=10, published_applied=10,
    )  # fmt: skip
    for i, member in enumerate(members):
        spec = Spec(int(key[-4:], 2) + i, round_, "honest", 0, 0)
        tensor = _tensor(spec, 11)
        reduction.contribute(ContributionHeader.of(tensor, member, fields, 500), tensor)
    reduction.close()
    for member in sorted(members, key=lambda m: m.peer_id):
        reduction.cosign(member.peer_id, member.sign(reduction.statement(member.peer_id)))
    assert isinstance(reduction.outcome, GroupUpdate)
    return reduction.outcome


class _Writer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> None:
        self.data += chunk

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        return None


def _reader(data: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    return reader


class Loopback:
    """The exchanges' streams in one process: a blob sent to a peer's `group-fetch` or
    `group-slice` handler is framed as dht.transport frames it and read by that handler;
    an answer comes back the same way. `tamper` may change what one sender sends."""

    def __init__(self) -> None:
        self.nodes: dict[str, GroupExchange] = {}
        self.sums: list[tuple[str, int]] = []
        """(sender, tensors) of each `sums` message sent."""
        self.tamper: Callable[[str, bytes], bytes] = lambda sender, blob: blob

    def network(self, identity: Identity) -> Any:
        hub = self

        async def send(peer: str, name: str, blob: bytes, *, timeout_s: float = 10.0) -> None:
            await hub.deliver(identity.peer_id, peer, name, blob)

        async def exchange(
            peer: str, name: str, blob: bytes, *, max_bytes: int, timeout_s: float
        ) -> bytes:
            answer = await hub.deliver(identity.peer_id, peer, name, blob)
            return await receive_blob(_reader(answer), max_bytes=max_bytes)

        config = SimpleNamespace(run_id=RUN)
        return SimpleNamespace(identity=identity, config=config, send=send, exchange=exchange)

    async def deliver(self, sender: str, peer: str, name: str, blob: bytes) -> bytes:
        if name == "group-fetch":
            blob = self.tamper(sender, blob)
            with contextlib.suppress(GroupMessageError):  # the receiver counts it
                message = decode_fetch(blob, NUMEL)
                if message.kind == "sums":
                    self.sums.append((sender, len(message.tensors)))
        node = self.nodes[peer]
        handler = {"group-fetch": node.rpc_fetch, "group-slice": node.rpc_slice}[name]
        writer = _Writer()
        framed = HEADER.pack(OK, len(blob)) + blob
        await handler(SimpleNamespace(peer_id=sender), _reader(framed), writer)
        return bytes(writer.data)


class Member:
    """One member: its pipeline (history, then its group's update), its exchange, what it
    counted and fetched whole."""

    def __init__(self, hub: Loopback, identity: Identity, own: GroupUpdate) -> None:
        self.pipeline = _base_pipeline(own)
        self.rejections: list[tuple[str, str]] = []
        self.whole: list[tuple[str, int, str]] = []
        self.events: list[dict[str, Any]] = []
        self.exchange = GroupExchange(
            hub.network(identity),
            numel=NUMEL,
            reject=lambda reason, peer, detail: self.rejections.append((reason, peer)),
            is_alive=lambda _: True,
            offer=lambda *a, **k: None,
            fetch=self._fetch,
            on_update=self._on_update,
            retain=_retain,
            shard_fetch=self.pipeline.groups,
            on_event=lambda name, **fields: self.events.append({"event": name, **fields}),
        )
        self.exchange.fetch_wait_s = 2.0
        hub.nodes[identity.peer_id] = self.exchange

    async def _fetch(self, peer: str, key: str, seq: int, cause: str = "") -> bytes | None:
        self.whole.append((key, seq, cause))
        return encode_update(next(u for u in OTHERS if (u.head.group_key, u.seq) == (key, seq)))

    def _on_update(self, update: GroupUpdate) -> bool:
        in_group = member_check(RUN, update.head.group_key)
        return self.pipeline.submit_group(update, in_group).accepted


async def _retain(update: GroupUpdate) -> None:
    return None


OWN_UPDATE = _update(OWN, MEMBERS, 0)
OTHERS = [_update(key, [AUTHORS[key]], r) for key in (ONE, TWO) for r in range(3)]
"""Six updates of two other groups (`_base_pipeline`: folds after the 1st and the 4th)."""


def _base_pipeline(own: GroupUpdate) -> UpdatePipeline:
    """Warm (4 updates of three learners: a fold, 1/3 of the next round), then the own
    group's update (2/3): the others' first completes a round, their fourth the next."""
    pipeline = _pipeline("delayed_nesterov")
    for g in range(4):
        warm = _path_update(Spec(g, 0, "honest", 0, 0), 2, LEARNERS)
        assert pipeline.submit_group(warm, _everyone).accepted
    assert pipeline.submit_group(own, member_check(RUN, OWN)).accepted
    return pipeline


def _holders_keep(hub: Loopback, others: list[GroupUpdate], members: Sequence[Any]) -> None:
    """One holder per other group on the pipe, keeping that group's updates in `others`, each
    a candidate of every member's exchange (`members`: anything with an `exchange`)."""
    for key, identity in HOLDERS.items():
        holder = GroupExchange(
            hub.network(identity), numel=NUMEL, reject=lambda *_: None,
            is_alive=lambda _: True, shard_fetch=_pipeline("delayed_nesterov").groups,
        )  # fmt: skip
        hub.nodes[identity.peer_id] = holder
        for update in others:
            if update.head.group_key == key:
                holder.keep(update)
                for member in members:
                    member.exchange.candidate(key, update.seq, identity.peer_id)


def _round(others: list[GroupUpdate], tamper: Callable[[str, bytes], bytes] | None = None):
    """The three members' fetch round over `others` (candidates from a holder that kept
    them); the members and the hub."""
    hub = Loopback()
    if tamper is not None:
        hub.tamper = tamper

    async def run() -> list[Member]:
        members = [Member(hub, identity, OWN_UPDATE) for identity in MEMBERS]
        _holders_keep(hub, others, members)
        ids = sorted(m.peer_id for m in MEMBERS)
        await asyncio.wait_for(
            asyncio.gather(*(m.exchange._fetch_round(OWN_UPDATE, ids) for m in members)), 30.0
        )
        return members

    return asyncio.run(run()), hub


def _reference(others: list[GroupUpdate]) -> UpdatePipeline:
    pipeline = _base_pipeline(OWN_UPDATE)
    for update in sorted(others, key=lambda u: (u.head.group_key, u.seq)):
        assert pipeline.submit_group(update, member_check(RUN, update.head.group_key)).accepted
    return pipeline


@pytest.mark.parametrize(("num_updates", "sums"), [(2, 2), (4, 2), (6, 3)])
def test_a_round_crossing_folds_gathers_a_sum_per_fold_and_fetches_nothing_whole(
    num_updates: int, sums: int
) -> None:
    """Two updates cross one fold (two sums), four end on the second (two: the params'
    sum is not the momentum's), six cross two (three): every member applies them all in the
    round, no update is fetched whole, the members end bit for bit alike and where applying
    them one by one ends."""
    others = sorted(OTHERS, key=lambda u: (u.head.group_key, u.seq))[:num_updates]
    members, hub = _round(others)
    for member in members:
        (event,) = [e for e in member.events if e["event"] == "shard_round"]
        assert event["outcome"] == "applied", event
        assert event["ids"] == event["applied"] == num_updates
        assert event["fallback_in_order"] == 0 and member.whole == []
        assert event["sums"] == sums
        assert member.rejections == []
    assert sorted(set(hub.sums)) == sorted((m.peer_id, sums) for m in MEMBERS)
    assert sums <= MAX_SUMS
    first = members[0].pipeline
    for other in members[1:]:
        assert torch.equal(other.pipeline.replica.params, first.replica.params)
    _assert_alike(_reference(others), first)


def _resigned(liar: Identity, count: int) -> Callable[[str, bytes], bytes]:
    """`liar` sends `count` sums instead of its plan's (signed by itself: its own doing)."""

    def tamper(sender: str, blob: bytes) -> bytes:
        message = decode_fetch(blob, NUMEL)
        if sender != liar.peer_id or message.kind != "sums":
            return blob
        tensors = (message.tensors * MAX_SUMS)[:count]
        lie = FetchMessage(message.run_id, message.round_id, "sums", sender, {}, tensors)
        return lie.signed(liar).to_bytes()

    return tamper


@pytest.mark.parametrize(
    ("count", "reason"),
    [
        (1, "group_fetch_sums_refused"),
        (0, "group_fetch_sums_refused"),
        (MAX_SUMS + 1, "group_fetch_malformed"),
    ],
)
def test_a_member_sending_another_number_of_sums_is_a_counted_rejection(
    count: int, reason: str
) -> None:
    """A round with one fold plans two sums: a member sending one (as a session 26 plan
    would), none, or more than `MAX_SUMS` is refused and counted against it by both other
    members; their round falls back (the ids fetched whole, in id order), nobody crashes."""
    others = sorted(OTHERS, key=lambda u: (u.head.group_key, u.seq))[:2]
    liar = sorted(MEMBERS, key=lambda m: m.peer_id)[0]
    members, _ = _round(others, _resigned(liar, count))
    honest = [m for m in members if m.exchange.identity.peer_id != liar.peer_id]
    for member in honest:
        assert (reason, liar.peer_id) in member.rejections
        (event,) = [e for e in member.events if e["event"] == "shard_round"]
        assert event["outcome"] != "applied"
        assert member.pipeline.replica.num_applied == _reference(others).replica.num_applied
