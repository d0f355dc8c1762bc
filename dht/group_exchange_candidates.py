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
from merge.group_pipeline import GroupMerge
from merge.group_update import GroupUpdate
from merge.shard_fetch import MAX_CANDIDATES, MAX_HOLDERS, UpdateId

logger = logging.getLogger(__name__)

FALLBACK_ROUNDS = 3.0
"""A candidate not applied this many group waits after its notice goes to the gossip."""
UNNOTICED_ROUNDS = 1.0
"""Group waits the gossip holds back another group's update no notice named (`held_back`)."""
MAX_KNOWN_KEYS = 64


class FetchCandidates:
    """FetchExchange's candidates, held back and handed over, and its in-order fallback."""

    if TYPE_CHECKING:  # what GroupExchange and FetchExchange provide
        numel: int
        fetch_wait_s: float
        _holds_back: bool
        _merge: GroupMerge | None
        _candidates: OrderedDict[UpdateId, tuple[str, ...]]
        _keys: OrderedDict[str, None]
        _first_wanted: OrderedDict[UpdateId, float]
        _released: OrderedDict[UpdateId, None]
        _own_keys: OrderedDict[str, None]
        _reject: Callable[[str, str, str], None]
        _offer: Callable[[str, int, str], object] | None
        _fetch: Callable[[str, str, int], Awaitable[bytes | None]] | None
        _on_update: Callable[[GroupUpdate], bool] | None

        async def _hold(self, update: GroupUpdate) -> None: ...
        def _spawn(self, coro: Any) -> None: ...

    # ---- candidates, held back and handed over ----------------------------------------------

    def candidate(self, group_key: str, seq: int, holder: str) -> None:
        """Another group's update a member completed (its notice): a candidate of this node's
        next fetch round, handed to the gossip if it is not applied in time."""
        uid = (group_key, seq)
        if not self._holds_back:  # no fetch round will come: the whole fetch at once
            if self._offer is not None:
                self._offer(group_key, seq, holder)
            return
        holders = self._candidates.get(uid, ())
        if holder not in holders and len(holders) < MAX_HOLDERS:
            self._candidates[uid] = (*holders, holder)
        while len(self._candidates) > 4 * MAX_CANDIDATES:
            self._hand_over(next(iter(self._candidates)))
        self._keys[group_key] = None
        self._keys.move_to_end(group_key)
        if len(self._keys) > MAX_KNOWN_KEYS:
            self._keys.popitem(last=False)
        if not holders:
            self._spawn(self._hand_over_later(uid, FALLBACK_ROUNDS * self.fetch_wait_s))

    async def _hand_over_later(self, uid: UpdateId, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self._hand_over(uid)

    def own_key(self, group_key: str) -> None:
        """A group key this node runs rounds of: its updates are not held back."""
        self._own_keys[group_key] = None
        self._own_keys.move_to_end(group_key)
        while len(self._own_keys) > MAX_KNOWN_KEYS:
            self._own_keys.popitem(last=False)

    def stop_holding(self) -> None:
        """This node runs no more rounds (it lingers or leaves): every candidate goes to the
        gossip now, and so does every later notice."""
        self._holds_back = False
        for uid in list(self._candidates):
            self._hand_over(uid)

    def held_back(self, uid: UpdateId) -> bool:
        """Whether the gossip waits before fetching `uid` whole (dht.catchup `held_back`):
        another group's update, wanted for less than FALLBACK_ROUNDS group waits and not
        handed over, may come by a fetch round. The gossip's repair and holder lookups find
        other groups' updates as fast as the notices do; without the wait they win the race
        and a fetch round's members stand on other applied sets."""
        if not self._holds_back or uid in self._released or not is_group_key(uid[0]):
            return False
        if uid[0] in self._own_keys:
            return False
        now = time.monotonic()
        first = self._first_wanted.setdefault(uid, now)
        while len(self._first_wanted) > 16 * MAX_CANDIDATES:
            self._first_wanted.popitem(last=False)
        # One group wait for an id no notice made a candidate (its notice may be on the way;
        # if it never comes, no fetch round takes it: session 18's bench lost 304 ids a
        # group ahead published, their notices refused as too far, held 3 waits until their
        # holder had dropped them).
        rounds = FALLBACK_ROUNDS if uid in self._candidates else UNNOTICED_ROUNDS
        return now - first < rounds * self.fetch_wait_s

    def _hand_over(self, uid: UpdateId) -> None:
        """A candidate to the gossip's whole fetch (unless applied here already)."""
        self._released[uid] = None
        while len(self._released) > 16 * MAX_CANDIDATES:
            self._released.popitem(last=False)
        holders = self._candidates.pop(uid, ())
        if self._offer is None or self._applied(uid):
            return
        for holder in holders:
            self._offer(uid[0], uid[1], holder)

    def _applied(self, uid: UpdateId) -> bool:
        return self._merge is not None and self._merge.pipeline.replica.has_applied(*uid)

    # ---- falling back in order -----------------------------------------------------------

    async def _fall_back(
        self, ids: Sequence[UpdateId], holders: Mapping[UpdateId, tuple[str, ...]]
    ) -> int:
        """Every member falls back alike: the ids all of them proposed, fetched whole (the
        gossip's `update` stream) and applied in id order, so that members at one state stay
        at one state (in arrival order, the gossip's, Delayed Nesterov folds other batches
        into each replica's momentum: docs/scale.md, Session 18). From the first id not
        fetched on, and every other candidate, to the gossip. The number applied here."""
        applied = 0
        try:
            if self._fetch is not None and self._on_update is not None:
                applied = await self._apply_in_order(ids, holders)
        except Exception as exc:  # a bug must not cost the node: the gossip
            logger.warning("falling back in order failed: %r", exc)
        for uid in list(self._candidates):
            self._hand_over(uid)
        return applied

    async def _apply_in_order(
        self, ids: Sequence[UpdateId], holders: Mapping[UpdateId, tuple[str, ...]]
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
        got = await asyncio.gather(*(self._whole(uid, holders.get(uid, ())) for uid in wanted))
        for uid, whole in zip(wanted, got, strict=True):
            if whole is None:
                break  # the rest would come out of order here and not elsewhere
            self._candidates.pop(uid, None)
            if await loop.run_in_executor(None, self._on_update, whole):
                applied += 1
                await self._hold(whole)
        return applied

    async def _whole(self, uid: UpdateId, holders: Sequence[str]) -> GroupUpdate | None:
        """`uid` whole from the first holder that serves it (checked when merged), or None."""
        assert self._fetch is not None
        for holder in holders:
            try:
                data = await self._fetch(holder, uid[0], uid[1])
            except Exception as exc:  # unreachable, timed out: the next holder
                logger.info("update %s from %s failed: %r", uid, holder, exc)
                continue
            if data is None:
                continue
            whole = parse_fetched(data, uid, self.numel)  # the gossip's checks and reasons
            if isinstance(whole, GroupUpdate):
                return whole
            self._reject(whole, holder, f"update {uid} fetched whole")
        return None
