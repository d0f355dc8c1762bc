"""The shard fetch's slices (dht.group_exchange_fetch; docs/scale.md, Sessions 17-18, 27):
the `group-slice` stream that serves exact ranges of the group updates this node completed
and kept (on the chunk grid, each piece with its shard's chunk digests: session 27),
and a fetch round member's side of it: this member's slice of each update of the round's set,
from a holder, checked, kept (bounded) for a later round. A mixin of
dht.group_exchange.GroupExchange (through dht.group_exchange_fetch.FetchExchange).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dht.budget import StreamLimits
from dht.group_exchange_reads import ExchangeReads
from dht.grouping import member_check
from dht.grouping_wire import GroupMessageError
from dht.resumable import is_refusal
from dht.shard_fetch_inbox import Fallback
from dht.shard_fetch_slices import (
    decode_slice_answer,
    holding_answer,
    parse_slice_ask,
    slice_ask,
)
from dht.shard_fetch_wire import slice_max_bytes
from dht.swarm_config import REQUEST_READ_TIMEOUT_S
from dht.transport import TransportError, receive_blob, send_blob, send_refusal
from merge.group_pipeline import GroupMerge
from merge.group_update import GroupUpdate
from merge.shard_fetch import (
    Composition,
    SlicePieces,
    UpdateId,
    incoming_of_headers,
    joined_slice,
    member_slice,
    slice_pieces_problem,
    variant_digest,
)
from merge.shard_holders import ShardHolding
from merge.shard_member import MemberRound
from merge.shard_round import Incoming, ShardRound

if TYPE_CHECKING:
    from dht.network import SwarmNetwork
    from merge.identity import Identity

logger = logging.getLogger(__name__)

SLICE_LIMITS = StreamLimits(rate_per_s=8.0, burst=32.0, max_in_flight=4, deadline_s=60.0)
"""Slice requests a peer may make: one per update of a fetch round, from each member."""
MAX_KEPT_UPDATES = 4
"""Group updates this node completed that it keeps whole to serve slices of."""
MAX_HELD_UPDATES = 16
"""Group updates this node holds some shards of (a folded round's member: about 2 / g of an
update each, Session 29): nobody holds a folded update whole, so these are what a replica
that missed it assembles it from, rounds later."""
KEPT_SLICE_MODELS = 2
"""Fetched slices kept for a later round, in model sizes of values (session 18: an update
deferred past a fold is fetched again by the next round, same members, same slice)."""


class SliceExchange(ExchangeReads):
    """FetchExchange's slices: kept updates served, this member's slices fetched and kept."""

    if TYPE_CHECKING:  # what GroupExchange and FetchExchange provide
        network: SwarmNetwork
        identity: Identity
        run_id: str
        numel: int
        shard_fetch: bool
        fetch_wait_s: float
        num_slices_reused: int
        num_slices_held: int
        _merge: GroupMerge | None
        _kept: OrderedDict[UpdateId, GroupUpdate]
        _holdings: OrderedDict[UpdateId, ShardHolding]
        _slices: OrderedDict[tuple[UpdateId, int, int], tuple[GroupUpdate, torch.Tensor]]
        _reject: Callable[[str, str, str], None]

        def _applied(self, uid: UpdateId) -> bool: ...
        async def _slice_by_shards(
            self,
            uid: UpdateId,
            holders: Sequence[str],
            start: int,
            end: int,
            unreachable: set[str] | None = None,
        ) -> tuple[GroupUpdate, torch.Tensor] | None: ...

    # ---- kept updates, served ------------------------------------------------------------

    def keep(self, update: GroupUpdate) -> None:
        """A group update this node completed: kept whole (bounded) to serve its slices."""
        if not self.shard_fetch:
            return
        uid = (update.head.group_key, update.seq)
        self._kept[uid] = update
        while len(self._kept) > MAX_KEPT_UPDATES:
            self._kept.popitem(last=False)

    def keep_shards(self, uid: UpdateId, holding: ShardHolding) -> None:
        """Some shards of a group update (checked when taken: merge.shard_holders), kept
        (bounded) to serve the ranges they cover: what a shard holder of a folded round
        serves (docs/scale.md, Session 28)."""
        self._holdings[uid] = holding
        self._holdings.move_to_end(uid)
        while len(self._holdings) > MAX_HELD_UPDATES:
            self._holdings.popitem(last=False)

    def _served(self, uid: UpdateId, start: int, end: int) -> ShardHolding | None:
        """What this node answers [start, end) of `uid` from: the update whole, or held
        shards that cover the range; None when neither."""
        update = self._kept.get(uid)
        if update is not None:
            return ShardHolding.of_whole(update)
        holding = self._holdings.get(uid)
        return holding if holding is not None and holding.covers(start, end) else None

    async def rpc_slice(self, info: Any, reader: Any, writer: Any) -> None:
        """Exactly the asked range of an update this node kept whole or holds the shards of,
        with its chunk digests and its fields (none when the ask names this variant: session
        28); a refusal when not held, or asked by a session 26 peer ("old_version")."""
        sender = str(info.peer_id)
        try:
            blob = await asyncio.wait_for(
                receive_blob(reader, max_bytes=4096), REQUEST_READ_TIMEOUT_S
            )
            try:
                uid, start, end, variant = parse_slice_ask(blob, self.numel)
            except GroupMessageError as exc:
                if exc.reason == "old_version":
                    await send_refusal(writer, "old_version: this node serves slices of DSS2")
                raise
            holding = self._served(uid, start, end)
            if holding is None:
                await send_refusal(writer, "not kept")
                return
            answer = await asyncio.to_thread(holding_answer, holding, uid, start, end, variant)
            await send_blob(writer, answer)
        except GroupMessageError as exc:
            self._reject(f"group_slice_{exc.reason}", sender, str(exc))
        except (TransportError, OSError, TimeoutError) as exc:
            logger.debug("slice request from %s failed: %r", sender, exc)

    # ---- this member's slices -------------------------------------------------------------

    async def _fetch_slices(
        self, composition: Composition, members: list[str]
    ) -> tuple[MemberRound, list[str]]:
        """This member's slice of each update of the set, checked; its `MemberRound` fed."""
        assert self._merge is not None
        me, numel = self.identity.peer_id, self.numel
        start, end = member_slice(numel, members, me)
        fetched = await asyncio.gather(
            *(self._fetch_one(uid, composition.holders[uid], start, end) for uid in composition.ids)
        )
        incoming: list[Incoming] = []
        for uid, (update, _) in zip(composition.ids, fetched, strict=True):
            key = uid[0]
            inc = incoming_of_headers(self._merge, update, numel, member_check(self.run_id, key))
            incoming.append(inc)
        # the sums travel in fp32: groups that applied a set in other rounds end within the
        # settle's tolerance of this one (bf16 sums: 4e-4 apart, a state download at the end);
        # decided past its Delayed Nesterov folds (2-3 sums, at most MAX_SUMS), not cut at the
        # first with the rest fetched whole by every member (session 27, second27)
        member = MemberRound(ShardRound(self._merge), members, me, incoming, until_fold=False)
        by_uid = {uid: piece for uid, (_, piece) in zip(composition.ids, fetched, strict=True)}
        for index in member.needs():
            if not member.fetched(index, by_uid[member.incoming[index].uid]):
                raise Fallback(member.failed or "slice_refused")
        variants = [variant_digest(update) for update, _ in fetched]
        return member, variants

    async def _fetch_one(
        self, uid: UpdateId, holders: tuple[str, ...], start: int, end: int
    ) -> tuple[GroupUpdate, torch.Tensor]:
        """The update's fields and this member's slice of it: kept from an earlier round,
        held here (shards this node holds that cover it: a folded round's own shard), from the
        first holder that serves it whole, or put together from the holders of the shards it
        meets (Session 28); Fallback when none does."""
        key = (uid, start, end)
        kept = self._slices.get(key)
        if kept is not None:
            self.num_slices_reused += 1
            return kept
        local = self._holdings.get(uid)
        if local is not None and local.covers(start, end):
            self.num_slices_held += 1
            return local.fields, torch.cat([p for _, p, _ in local.pieces(start, end)])
        unreachable: set[str] = set()
        for holder in holders:
            got = await self._ask_slice(holder, uid, start, end, unreachable)
            if got is not None:
                self._keep_slice(key, got)
                return got
        reached = [h for h in holders if h not in unreachable]  # they hold some shards, or none
        if local is None and not reached:
            raise Fallback("fetch_failed")
        got = await self._slice_by_shards(uid, reached, start, end, unreachable)
        if got is None:
            raise Fallback("fetch_failed")
        self._keep_slice(key, got)
        return got

    def _keep_slice(
        self, key: tuple[UpdateId, int, int], got: tuple[GroupUpdate, torch.Tensor]
    ) -> None:
        """Kept for a later round: at most KEPT_SLICE_MODELS x the model's values, those of
        updates applied here dropped first, then the oldest."""
        self._slices[key] = got
        for old in [k for k in self._slices if self._applied(k[0])]:
            del self._slices[old]
        while sum(t.numel() for _, t in self._slices.values()) > KEPT_SLICE_MODELS * self.numel:
            self._slices.popitem(last=False)

    async def _ask_slice(
        self, holder: str, uid: UpdateId, start: int, end: int, unreachable: set[str] | None = None
    ) -> tuple[GroupUpdate, torch.Tensor] | None:
        got = await self._ask_pieces(holder, uid, start, end, unreachable=unreachable)
        if got is None:
            return None
        return self._checked_slice(holder, uid, *got, start, end)

    async def _ask_pieces(
        self,
        holder: str,
        uid: UpdateId,
        start: int,
        end: int,
        known: GroupUpdate | None = None,
        unreachable: set[str] | None = None,
    ) -> tuple[GroupUpdate, SlicePieces] | None:
        """[start, end) of `uid` as `holder` answers it, decoded (not checked yet); without
        the update's fields when this node holds them (`known`, session 28). A holder that
        did not answer (not a refusal: unreachable, timed out) or answered what does not
        decode joins `unreachable`, which the caller asks no more this time."""
        numel = self.numel
        variant = None if known is None else variant_digest(known)
        try:
            blob = await self.network.exchange(
                holder,
                "group-slice",
                slice_ask(uid, start, end, variant),
                max_bytes=slice_max_bytes(numel),
                timeout_s=self.fetch_wait_s,
            )
            update, pieces = decode_slice_answer(blob, numel, uid, known)
        except GroupMessageError as exc:
            self._reject(f"group_slice_{exc.reason}", holder, str(exc))
            if unreachable is not None:  # counted once: not asked again this time
                unreachable.add(holder)
            return None
        except Exception as exc:  # refused, unreachable, timed out: the next holder
            logger.info("slice of %s from %s failed: %r", uid, holder, exc)
            if unreachable is not None and not is_refusal(exc):
                unreachable.add(holder)
            return None
        self._received("slice", holder, len(blob))
        return update, pieces

    def _checked_slice(
        self,
        holder: str,
        uid: UpdateId,
        update: GroupUpdate,
        pieces: SlicePieces,
        start: int,
        end: int,
    ) -> tuple[GroupUpdate, torch.Tensor] | None:
        """The update and exactly [start, end) of it, when the holder's answer is that: each
        piece checked against its shard's co-signed chunk root (a counted rejection else)."""
        in_group = member_check(self.run_id, uid[0])
        problem = "wrong_update" if (update.head.group_key, update.seq) != uid else None
        problem = problem or update.header_problem(in_group)
        problem = problem or slice_pieces_problem(update, pieces, self.numel, start, end)
        if problem is not None:
            self._reject(f"group_slice_{problem}", holder, f"{uid}")
            return None
        return update, joined_slice(pieces)
