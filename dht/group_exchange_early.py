"""What reaches a learner-group member for a round it has not opened yet: the `group-part`
stream, the parts held (bounded: the newest `MAX_HELD_ROUNDS` rounds, one part per member
each) until the round opens here, and the senders booked from them (dht.grouping_census). A
mixin of dht.group_exchange.GroupExchange, which holds the state it uses; split out of it in
session 26 (moves, not rewrites). And `_follow`, the wait for another member's first part of a
round before opening it (dht.grouping_follow: a member whose last round there ended alone).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dht.group_exchange_reads import ExchangeReads
from dht.group_exchange_shards import new_refusal, own_message
from dht.grouping import member_check
from dht.grouping_follow import FOLLOW_TICK_S, Follower
from dht.grouping_shards import ShardedRound
from dht.grouping_wire import RoundId, decode_part, part_max_bytes
from merge.group_update import ContributionHeader

if TYPE_CHECKING:
    from dht.grouping_census import SenderBook
    from dht.grouping_round import GroupRound
    from merge.identity import Identity

MAX_HELD_ROUNDS = 4
"""Rounds whose parts are held before this node opens them (the oldest dropped first)."""


class EarlyExchange(ExchangeReads):
    """GroupExchange's parts for rounds not opened here yet (see the module's docstring)."""

    if TYPE_CHECKING:  # what GroupExchange provides
        identity: Identity
        run_id: str
        numel: int
        senders: SenderBook
        follower: Follower
        _on_event: Callable[..., None] | None
        highest_round: dict[str, int]
        _rounds: dict[RoundId, GroupRound | ShardedRound]
        _wakes: dict[RoundId, asyncio.Event]
        _held: OrderedDict[RoundId, dict[str, tuple[ContributionHeader, torch.Tensor]]]
        _held_since: dict[RoundId, float]
        _is_alive: Callable[[str], bool]
        _reject: Callable[[str, str, str], None]

    async def rpc_part(self, info: Any, reader: Any, writer: Any) -> None:
        sender = str(info.peer_id)

        def decode(blob: bytes) -> tuple[ContributionHeader, torch.Tensor]:
            header, tensor = decode_part(blob, self.numel)
            own_message(header, sender, self.run_id, "a part")
            return header, tensor

        part = await self._take("group_part", sender, reader, part_max_bytes(self.numel), decode)
        if part is None:
            return
        header, tensor = part
        self._book(header)
        self._take_part(header, tensor)

    def _take_part(self, header: ContributionHeader, tensor: torch.Tensor) -> None:
        rid = (header.group_key, header.epoch, header.round)
        member = self._rounds.get(rid)
        if isinstance(member, ShardedRound):
            self._reject("group_part_not_sharded", header.author, "a whole part, pieces expected")
            return
        if member is not None:
            before = dict(member.reduction.rejected)
            if member.on_part(header, tensor):
                self._note_round(header)
            else:  # after_deadline (a late member), duplicate, wrong_round, headers_disagree...
                reason = new_refusal(before, member.reduction.rejected)
                self._reject(f"group_part_{reason}", header.author, "a part this round refused")
            self._wakes[rid].set()
            return
        if not (member_check(self.run_id, header.group_key)(header.author)):
            self._reject("group_part_not_a_member", header.author, "a part for another group")
            return
        if not self._is_alive(header.author):
            return  # held only for live peers: a fresh key's parts take no memory here
        held = self._holding(self._held, rid)
        if header.author not in held:  # one per author and round: a resend changes nothing
            held[header.author] = (header, tensor)
            self._note_round(header)

    def _book(self, header: ContributionHeader) -> None:
        """Books the sender of a part or piece (dht.grouping_census) when it is alive, inside
        its header's group and signed it, once per (group, epoch, sender) taken or not; then
        its rounds (the transport named the sender, `own_message`): what keeps it listed."""
        key, epoch, author = header.group_key, header.epoch, header.author
        if author == self.identity.peer_id or self.senders.knows(key, epoch, author):
            self.senders.heard(key, epoch, author, header.round)
            return
        if not member_check(self.run_id, key)(author) or not self._is_alive(author):
            return
        if header.verified():
            self.senders.add(key, epoch, author, header.round)

    def _holding(self, store: OrderedDict[RoundId, dict[Any, Any]], rid: RoundId) -> dict[Any, Any]:
        """What `store` holds for a round that has not opened here (parts or pieces), made
        empty the first time, the oldest round dropped past MAX_HELD_ROUNDS; `_held_since`
        keeps when the round's first message was here."""
        held = store.get(rid)
        if held is None:
            if len(store) >= MAX_HELD_ROUNDS:
                oldest, _ = store.popitem(last=False)
                self._held_since.pop(oldest, None)
            held = store[rid] = {}
            self._held_since.setdefault(rid, time.monotonic())
        return held

    def _note_round(self, header: ContributionHeader) -> None:
        key = header.group_key
        self.highest_round[key] = max(self.highest_round.get(key, -1), header.round)

    async def _follow(self, rid: RoundId, wait_s: float) -> None:
        """Before this member opens round `rid`: when its last round ended alone in the same group,
        wait (bounded) for another member's first part or piece of `rid`, which it then joins
        (dht.grouping_follow); `group_followed` says how long and what ended the wait."""
        key, epoch, round_ = rid
        wait = self.follower.wait(rid, time.monotonic(), self._held_since.get(rid), wait_s)
        if wait is None:
            return
        while True:
            now = time.monotonic()
            ended = wait.ended(now, self._held_since.get(rid), self.highest_round.get(key, -1))
            if ended is not None:
                break
            await asyncio.sleep(min(FOLLOW_TICK_S, max(wait.until - now, 0.0)))
        if self._on_event is not None:
            waited_s = round(now - wait.since, 3)
            self._on_event(
                "group_followed", group_key=key, epoch=epoch, round=round_, waited_s=waited_s,
                ended=ended,
            )  # fmt: skip
