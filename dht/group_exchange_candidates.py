"""The shard fetch's candidates (dht.group_exchange_fetch; docs/scale.md, Sessions 17-18):
other groups' updates a `group-done` notice named, held back from the gossip's whole fetch
until a fetch round applies them, and the fallback path for those it does not: handed to the
gossip (`FALLBACK_ROUNDS` x the group wait after the notice at the latest), or, when a
round's members fall back alike, fetched whole and applied in id order. A mixin of
dht.group_exchange.GroupExchange (through dht.group_exchange_fetch.FetchExchange).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dht.gossip_groups import is_group_key, parse_fetched
from dht.grouping import member_check
from dht.shard_fetch_hold import FALLBACK_ROUNDS, UNNOTICED_ROUNDS, HoldBook
from merge.group_pipeline import GroupMerge
from merge.group_update import GroupUpdate
from merge.shard_fetch import MAX_CANDIDATES, MAX_HOLDERS, UpdateId

__all__ = ["FALLBACK_ROUNDS", "UNNOTICED_ROUNDS", "FetchCandidates"]

logger = logging.getLogger(__name__)

MAX_KNOWN_KEYS = 64


def with_own(
    ids: Sequence[UpdateId],
    holders: Mapping[UpdateId, tuple[str, ...]],
    own: UpdateId | None,
    members: Sequence[str],
) -> tuple[tuple[UpdateId, ...], dict[UpdateId, tuple[str, ...]]]:
    """A fetch round's fallback ids and holders, with a folded round's own update (`own`)
    among them in id order, held by the round's members (Session 29: nobody else applies
    it, and it was a candidate of this round whatever failed)."""
    out = dict(holders)
    if own is None:
        return tuple(ids), out
    out[own] = tuple(out.get(own, ())) or tuple(members)
    return tuple(sorted({*ids, own})), out


class FetchCandidates:
    """FetchExchange's candidates, held back and handed over, and its in-order fallback."""

    if TYPE_CHECKING:  # what GroupExchange and FetchExchange provide
        numel: int
        run_id: str
        fetch_wait_s: float
        _merge: GroupMerge | None
        _candidates: OrderedDict[UpdateId, tuple[str, ...]]
        _keys: OrderedDict[str, None]
        _holdbook: HoldBook
        _timers: set[UpdateId]
        _reject: Callable[[str, str, str], None]
        _offer: Callable[..., object] | None
        _fetch: Callable[..., Awaitable[bytes | None]] | None
        _on_update: Callable[[GroupUpdate], bool] | None

        async def _hold(self, update: GroupUpdate) -> None: ...
        def _spawn(self, coro: Any) -> None: ...
        async def _assembled(self, uid: UpdateId, holders: Sequence[str]) -> GroupUpdate | None: ...

    # ---- candidates, held back and handed over ----------------------------------------------

    def candidate(self, group_key: str, seq: int, holder: str) -> None:
        """Another group's update a member completed (its notice): a candidate of this node's
        next fetch round, handed to the gossip if it is not applied in time."""
        uid = (group_key, seq)
        if not self._holdbook.holding:  # no fetch round will come: the whole fetch at once
            if self._offer is not None:
                self._offer(group_key, seq, holder, cause="not_holding")
            return
        self._holdbook.noticed(uid, time.monotonic(), self.fetch_wait_s)
        self._add_candidate(uid, (holder,))
        self._keys[group_key] = None
        self._keys.move_to_end(group_key)
        if len(self._keys) > MAX_KNOWN_KEYS:
            self._keys.popitem(last=False)

    def _add_candidate(self, uid: UpdateId, holders: Sequence[str]) -> None:
        """`holders` of `uid` noted (a candidate of the next round) and its hand-over timed."""
        known = self._candidates.get(uid, ())
        for holder in holders:
            if holder not in known and len(known) < MAX_HOLDERS:
                known = (*known, holder)
        self._candidates[uid] = known
        while len(self._candidates) > 4 * MAX_CANDIDATES:
            self._hand_over(next(iter(self._candidates)), "overflow")
        if uid in self._candidates and uid not in self._timers:
            self._timers.add(uid)
            self._spawn(self._hand_over_when_due(uid))

    async def _hand_over_when_due(self, uid: UpdateId) -> None:
        """Waits out `uid`'s hand-over time (a later notice may move it), then hands it over
        unless a round applied it."""
        try:
            while (due := self._holdbook.due(uid)) is not None:
                left = due - time.monotonic()
                if left <= 0:
                    self._hand_over(uid, self._holdbook.cause_due(uid))
                    return
                await asyncio.sleep(left)
        finally:
            self._timers.discard(uid)

    def own_key(self, group_key: str) -> None:
        """A group key this node runs rounds of: its updates are not held back."""
        self._holdbook.own_key(group_key)

    def stop_holding(self) -> None:
        """This node runs no more rounds (it lingers or leaves): every candidate goes to the
        gossip now, and so does every later notice."""
        self._holdbook.holding = False
        for uid in list(self._candidates):
            self._hand_over(uid, "stop")

    def held_back(self, uid: UpdateId, sources: Sequence[str] = ()) -> bool:
        """Whether the gossip waits before fetching `uid` whole (dht.catchup `held_back`,
        decided by dht.shard_fetch_hold `HoldBook`): another group's update the gossip wants
        (`sources`: its live holders) is a candidate of this node's next fetch round until
        its hand-over time. The gossip's repair and holder lookups find other groups'
        updates as fast as the notices do; fetched whole, they reach members at moments of
        their own and a fetch round's members stand on other states."""
        now = time.monotonic()
        was_held = self._holdbook.due(uid) is not None
        in_group = member_check(self.run_id, uid[0]) if is_group_key(uid[0]) else None
        # a fetch round asks holders for slices of what they completed: its group's members
        members = [s for s in sources if in_group is not None and in_group(s)]
        verdict = self._holdbook.verdict(uid, members, now, self.fetch_wait_s)
        if verdict.adopt:
            self._add_candidate(uid, members)
        elif was_held and self._holdbook.due(uid) is None and uid in self._candidates:
            self._hand_over(uid, self._holdbook.cause(uid) or "timer", released=True)
        return verdict.held

    def _hand_over(self, uid: UpdateId, cause: str, *, released: bool = False) -> None:
        """A candidate to the gossip's whole fetch (unless applied here already), for `cause`
        (its update_fetched event's)."""
        if not released:
            self._holdbook.release(uid, time.monotonic(), cause)
        holders = self._candidates.pop(uid, ())
        if self._offer is None or self._applied(uid):
            return
        for holder in holders:
            self._offer(uid[0], uid[1], holder, cause=f"handed_over_{cause}")

    def _taken(self, uid: UpdateId) -> None:
        """A round (or its in-order fallback) applied `uid`: no candidate, nothing held."""
        self._candidates.pop(uid, None)
        self._holdbook.applied(uid)

    def _applied(self, uid: UpdateId) -> bool:
        return self._merge is not None and self._merge.pipeline.replica.has_applied(*uid)

    # ---- falling back in order -----------------------------------------------------------

    async def _fall_back(
        self,
        ids: Sequence[UpdateId],
        holders: Mapping[UpdateId, tuple[str, ...]],
        reason: str = "fallback",
    ) -> int:
        """Every member falls back alike: the ids all of them proposed, fetched whole (the
        gossip's `update` stream) and applied in id order, so that members at one state stay
        at one state (in arrival order, the gossip's, Delayed Nesterov folds other batches
        into each replica's momentum: docs/scale.md, Session 18). From the first id not
        fetched on, and every other candidate, stay candidates of the next round until their
        hand-over time (session 22 handed them to the gossip at once: fetched whole at
        moments of each member's own). The number applied here."""
        try:
            if self._fetch is not None and self._on_update is not None:
                return await self._apply_in_order(ids, holders, f"in_order_{reason}")
        except Exception as exc:  # a bug must not cost the node: the candidates' timers
            logger.warning("falling back in order failed: %r", exc)
        return 0

    async def _apply_in_order(
        self,
        ids: Sequence[UpdateId],
        holders: Mapping[UpdateId, tuple[str, ...]],
        cause: str = "in_order_deferred",
    ) -> int:
        """`ids` fetched whole and applied in id order up to the first not fetched (what is
        left stays a candidate). After an applied round, its updates deferred past the fold
        (session 18: a group that publishes faster than a round's fold cut takes left them
        waiting out the hold-back, by when their holder had dropped them: lost), so the
        members, at one state after the round, stay at one."""
        if self._fetch is None or self._on_update is None or not ids:
            return 0
        applied, loop = 0, asyncio.get_running_loop()
        wanted = [uid for uid in ids if not self._applied(uid)]
        got = await asyncio.gather(
            *(self._whole(uid, holders.get(uid, ()), cause) for uid in wanted)
        )
        for uid, whole in zip(wanted, got, strict=True):
            if whole is None:
                break  # the rest would come out of order here and not elsewhere
            self._taken(uid)
            if await loop.run_in_executor(None, self._on_update, whole):
                applied += 1
                await self._hold(whole)
        return applied

    async def _whole(self, uid: UpdateId, holders: Sequence[str], cause: str) -> GroupUpdate | None:
        """`uid` whole from the first holder that serves it (checked when merged), or None;
        `cause`: the update_fetched event's."""
        assert self._fetch is not None
        for holder in holders:
            try:
                data = await self._fetch(holder, uid[0], uid[1], cause=cause)
            except Exception as exc:  # unreachable, timed out: the next holder
                logger.info("update %s from %s failed: %r", uid, holder, exc)
                continue
            if data is None:
                continue
            whole = parse_fetched(data, uid, self.numel)  # the gossip's checks and reasons
            if isinstance(whole, GroupUpdate):
                return whole
            self._reject(whole, holder, f"update {uid} fetched whole")
        return await self._assembled(uid, holders)  # no whole holder: from its shards
