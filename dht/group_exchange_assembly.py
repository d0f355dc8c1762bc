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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from dht.group_exchange_reads import ExchangeReads
from dht.grouping import member_check
from merge.group_update import GroupUpdate
from merge.shard_fetch import SlicePieces, UpdateId, variant_digest
from merge.shard_holders import ShardAssembly, shard_holders

if TYPE_CHECKING:
    from merge.identity import Identity

logger = logging.getLogger(__name__)


class AssemblyExchange(ExchangeReads):
    """Whole updates from their shards' holders (see the module's docstring)."""

    if TYPE_CHECKING:  # what GroupExchange and SliceExchange provide
        identity: Identity
        run_id: str
        numel: int
        shard_fetch: bool
        num_assembled: int
        _reject: Callable[[str, str, str], None]

        async def _ask_pieces(
            self,
            holder: str,
            uid: UpdateId,
            start: int,
            end: int,
            known: GroupUpdate | None = None,
        ) -> tuple[GroupUpdate, SlicePieces] | None: ...

    async def _assembled(self, uid: UpdateId, holders: Sequence[str]) -> GroupUpdate | None:
        """`uid` whole from its shards' holders (None: no fields, or a shard no live holder
        served); only where slices are served (--group-shard-fetch)."""
        if not self.shard_fetch:
            return None
        fields = await self._fields(uid, holders)
        if fields is None:
            return None
        assembly = ShardAssembly(fields, self.numel)
        bounds = fields.shard_bounds(self.numel)
        for shard in assembly.missing():
            lo, hi = bounds[shard]
            if lo == hi and assembly.take(shard, (), torch.zeros(0)) is None:
                continue  # an empty shard (a model smaller than its group's chunks)
            asked = dict.fromkeys([*shard_holders(fields, shard), *holders])
            for holder in asked:
                if holder == self.identity.peer_id:
                    continue
                if await self._take_shard(assembly, holder, uid, shard, bounds[shard]):
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

    async def _fields(self, uid: UpdateId, holders: Sequence[str]) -> GroupUpdate | None:
        """The update's fields from the first holder that serves them, their headers checked
        (a counted rejection else)."""
        in_group = member_check(self.run_id, uid[0])
        for holder in holders:
            got = await self._ask_pieces(holder, uid, 0, 0)
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
    ) -> bool:
        """Shard `shard` from `holder`, kept when it checks; False: the next holder. A holder
        of another variant (it answered with other fields) is skipped, not counted: two
        honest variants of one round both have holders."""
        got = await self._ask_pieces(holder, uid, *bounds, known=assembly.fields)
        if got is None:
            return False
        fields, pieces = got
        if variant_digest(fields) != variant_digest(assembly.fields):
            return False
        if set(pieces) != {shard}:
            self._reject("group_slice_shard_index", holder, f"{uid} shard {shard}")
            return False
        problem = assembly.take(shard, *pieces[shard])
        if problem is not None:
            self._reject(f"group_slice_{problem}", holder, f"{uid} shard {shard}")
        return problem is None
