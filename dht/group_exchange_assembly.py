"""A whole group update assembled from its shards' holders when no holder serves it whole
(issue 22, must-have 2; docs/scale.md, Session 28). A mixin of
dht.group_exchange.GroupExchange (through dht.group_exchange_fetch.FetchExchange), used where
a whole update is fetched: a fetch round's fallback in id order
(dht.group_exchange_candidates `_whole`) and an update a notice tells of
(dht.group_exchange_done `_fetch_update`: adopting a round's update, another variant).

The fields come first, from a holder the caller names (a `group-slice` ask of the empty range
[0, 0): the update's fields, no values; their headers checked); then each shard from its
holders (merge.shard_holders `shard_holders`: its reducer, then the next included member),
then the caller's holders, asked without the fields; every piece is checked against its
reducer's co-signed chunk root before it is kept (merge.shard_holders `ShardAssembly`), and
the whole update passes `GroupUpdate.problem` before anyone uses it. A holder's wrong answer
is counted against it (`group_slice_<reason>`) and the next one asked. Bytes: the fields
once (a whole fetch carries them once too) and each shard once.

Session 30: a member whose own round of the update is still running here (it retried, or
waits out its co-sign deadline, while another member completed on seals) takes the shards
that round had from itself (`_local`: merge.group_shards `values_for`), so it can adopt the
update even when it is the only live holder of one of its shards.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from dht.group_exchange_reads import ExchangeReads
from dht.grouping import member_check
from dht.grouping_shards import ShardedRound
from dht.grouping_wire import RoundId
from merge.group_update import GroupUpdate
from merge.shard_fetch import (
    SlicePieces,
    UpdateId,
    joined_slice,
    slice_pieces_problem,
    variant_digest,
    wanted_pieces,
)
from merge.shard_holders import ShardAssembly, ShardHolding, shard_holders

if TYPE_CHECKING:
    from merge.identity import Identity

logger = logging.getLogger(__name__)

MAX_GROUP_ASKED = 8
"""Live peers of an update's group a catch-up's assembly asks besides the named holders."""


class AssemblyExchange(ExchangeReads):
    """Whole updates from their shards' holders (see the module's docstring)."""

    if TYPE_CHECKING:  # what GroupExchange and SliceExchange provide
        identity: Identity
        run_id: str
        numel: int
        shard_fetch: bool
        num_assembled: int
        _live_peers: Callable[[], list[str]]
        _holdings: OrderedDict[UpdateId, ShardHolding]
        _rounds: Mapping[RoundId, object]
        _reject: Callable[[str, str, str], None]

        async def _ask_pieces(
            self,
            holder: str,
            uid: UpdateId,
            start: int,
            end: int,
            known: GroupUpdate | None = None,
            unreachable: set[str] | None = None,
        ) -> tuple[GroupUpdate, SlicePieces] | None: ...

    async def assemble(self, uid: UpdateId, holders: Sequence[str]) -> GroupUpdate | None:
        """`_assembled`, for the gossip's catch-up (dht.gossip_fetch `Fetcher.assemble`): a
        peer that refused the update whole may hold some of its shards; after it, the live
        peers inside the update's group (at most MAX_GROUP_ASKED: a folded round's members
        hold its shards and nobody announces it whole, Session 29), whom repair's sources
        (any replica that applied it) need not name."""
        in_group = member_check(self.run_id, uid[0])
        members = [p for p in self._live_peers() if in_group(p)][:MAX_GROUP_ASKED]
        return await self._assembled(uid, list(dict.fromkeys([*holders, *members])))

    async def _assembled(self, uid: UpdateId, holders: Sequence[str]) -> GroupUpdate | None:
        """`uid` whole from its shards' holders (None: no fields, or a shard no live holder
        served); only where slices are served (--group-shard-fetch)."""
        if not self.shard_fetch:
            return None
        gone: set[str] = set()
        local = self._holdings.get(uid)  # a folded round's member holds some shards itself
        fields = local.fields if local is not None else await self._fields(uid, holders, gone)
        if fields is None:
            return None
        local = local or self._local(uid, fields)
        assembly = ShardAssembly(fields, self.numel)
        bounds = fields.shard_bounds(self.numel)
        for shard in assembly.missing():
            lo, hi = bounds[shard]
            if lo == hi and assembly.take(shard, (), torch.zeros(0)) is None:
                continue  # an empty shard (a model smaller than its group's chunks)
            if local is not None and shard in local.shards:
                ((_, piece, digests),) = local.pieces(lo, hi)
                if assembly.take(shard, digests, piece) is None:
                    continue
            asked = dict.fromkeys([*shard_holders(fields, shard), *holders])
            for holder in asked:
                if holder == self.identity.peer_id or holder in gone:
                    continue
                if await self._take_shard(assembly, holder, uid, shard, bounds[shard], gone):
                    break
            else:
                logger.info("update %s: no holder served shard %d", uid, shard)
                return None
        whole = assembly.whole(member_check(self.run_id, uid[0]))
        if isinstance(whole, str):  # every shard checked: a bug if it ever fails
            logger.warning("update %s assembled from shards refused: %s", uid, whole)
            return None
        self.num_assembled += 1
        return whole

    def _local(self, uid: UpdateId, fields: GroupUpdate) -> ShardHolding | None:
        """The shards of `fields` (the update `uid`) this node's round of it, still running
        here, had (any attempt; each one's digest the one `fields` names), or None."""
        for (key, _, round_), member in self._rounds.items():
            if key == uid[0] and round_ + 1 == uid[1] and isinstance(member, ShardedRound):
                values = member.reduction.values_for(fields)
                try:
                    return ShardHolding.of_shards(fields, self.numel, values) if values else None
                except ValueError as exc:  # digests matched: a bug if it ever fails
                    logger.warning("update %s: a running round's shards refused: %s", uid, exc)
        return None

    async def _slice_by_shards(
        self,
        uid: UpdateId,
        holders: Sequence[str],
        start: int,
        end: int,
        unreachable: set[str] | None = None,
    ) -> tuple[GroupUpdate, torch.Tensor] | None:
        """[start, end) of `uid` put together from the shards it meets: those held here, the
        rest from each shard's holders (its reducer, then the next included member, then
        `holders`), asked without the fields, each piece checked against its shard's
        co-signed chunk root; None when a shard has no holder that serves it. What a fetch
        round's member does when no holder serves its slice whole (a folded round's update:
        its holders hold shards; with churn, its own slice is not its own shard)."""
        gone = set() if unreachable is None else unreachable
        local = self._holdings.get(uid)
        fields = local.fields if local is not None else await self._fields(uid, holders, gone)
        if fields is None:
            return None
        local = local or self._local(uid, fields)
        pieces: dict[int, tuple[tuple[str, ...], torch.Tensor]] = {}
        for shard, a, b in wanted_pieces(fields.num_shards, self.numel, start, end):
            if local is not None and shard in local.shards:
                ((_, piece, digests),) = local.pieces(a, b)
                pieces[shard] = (digests, piece)
                continue
            asked = dict.fromkeys([*shard_holders(fields, shard), *holders])
            for holder in asked:
                if holder == self.identity.peer_id or holder in gone:
                    continue
                got = await self._piece_of(fields, holder, uid, shard, a, b, gone)
                if got is not None:
                    pieces[shard] = got
                    break
            else:
                logger.info("slice of %s: no holder served shard %d", uid, shard)
                return None
        problem = slice_pieces_problem(fields, pieces, self.numel, start, end)
        if problem is not None:  # every piece checked: a bug if it ever fails
            logger.warning("slice of %s from shards refused: %s", uid, problem)
            return None
        return fields, joined_slice(pieces)

    async def _piece_of(
        self,
        fields: GroupUpdate,
        holder: str,
        uid: UpdateId,
        shard: int,
        a: int,
        b: int,
        unreachable: set[str] | None = None,
    ) -> tuple[tuple[str, ...], torch.Tensor] | None:
        """[a, b) of shard `shard` from `holder`, checked (a counted rejection else); None
        from a holder of another variant (not counted) or one that does not serve it."""
        got = await self._ask_pieces(holder, uid, a, b, known=fields, unreachable=unreachable)
        if got is None or variant_digest(got[0]) != variant_digest(fields):
            return None
        pieces = got[1]
        if set(pieces) != {shard}:
            self._reject("group_slice_shard_index", holder, f"{uid} shard {shard}")
            return None
        digests, piece = pieces[shard]
        problem = fields.slice_problem(shard, digests, a, piece, self.numel)
        if problem is not None:
            self._reject(f"group_slice_{problem}", holder, f"{uid} shard {shard}")
            return None
        return digests, piece

    async def _fields(
        self, uid: UpdateId, holders: Sequence[str], unreachable: set[str]
    ) -> GroupUpdate | None:
        """The update's fields from the first holder that serves them, their headers checked
        (a counted rejection else); holders in `unreachable` are not asked."""
        in_group = member_check(self.run_id, uid[0])
        for holder in holders:
            if holder in unreachable:
                continue
            got = await self._ask_pieces(holder, uid, 0, 0, unreachable=unreachable)
            if got is None:
                continue
            fields, pieces = got
            problem = "wrong_update" if (fields.head.group_key, fields.seq) != uid else None
            problem = problem or ("shard_index" if pieces else fields.header_problem(in_group))
            if problem is None:
                return fields
            self._reject(f"group_slice_{problem}", holder, f"{uid}")
        return None

    async def _take_shard(
        self,
        assembly: ShardAssembly,
        holder: str,
        uid: UpdateId,
        shard: int,
        bounds: tuple[int, int],
        unreachable: set[str],
    ) -> bool:
        """Shard `shard` from `holder`, kept when it checks (`_piece_of`); False: the next
        holder."""
        got = await self._piece_of(assembly.fields, holder, uid, shard, *bounds, unreachable)
        return got is not None and assembly.take(shard, *got) is None
