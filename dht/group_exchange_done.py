"""The `group-done` stream of a learner group's round: the notice a member that completed its
round sends (`push_targets`: to whom), and what a node does with one it receives. A mixin of
dht.group_exchange.GroupExchange, which holds the state it uses (the rounds running here and
settled, the member lists they ran with) and the streams' plumbing.

`group-done`: a member that completed its round retains the update (`retain`: the gossip's,
announced in its holder record) and sends a small notice (round id and included set) to the
other members and its share of the peers outside the group, instead of the update itself
(session 10 pushed the whole update to every member: 350 of 459 pushes were duplicates). A
member still waiting on the round fetches it from the notifier only when it cannot complete
by itself (`done_action`: another included set, or co-signatures late) and adopts it; a
peer outside the group hands the id to the gossip (`offer`), whose catch-up fetches it once
from one holder and merges it. Since session 14 the notice is signed by its notifier and what
one may make this node want is bounded (dht.group_notice); an unsigned one is refused, counted.
Since session 26 a notice names its variant: a node that holds another variant of the round
fetches the named one from the notifier, once, and merges it, so the two variants meet and
the proof forms (`_watch_variant`, dht.variant_fetches).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from dht.budget import StreamLimits
from dht.group_exchange_reads import ExchangeReads
from dht.group_notice import decode_notice, notice_max_bytes, notice_refusal
from dht.grouping import member_check
from dht.grouping_done import Done, done_action
from dht.grouping_round import GroupRound
from dht.grouping_shards import ShardedRound
from dht.grouping_wire import GroupMessageError, RoundId, decode_update
from dht.variant_fetches import VARIANT_POLL_S, VARIANT_WAIT_S, VariantFetches, served_refusal
from merge.group_equivocation import GroupVariant
from merge.group_update import GroupUpdate
from merge.shard_holders import ShardHolding

DONE_LIMITS = StreamLimits(rate_per_s=4.0, burst=16.0, max_in_flight=4, deadline_s=10.0)
"""Group-done notices a peer may send: one per round it completed (to members and its share
of the peers outside the group)."""
COPIES = 2
"""Members that push a complete group update to each live peer outside the group."""


class DoneExchange(ExchangeReads):
    """GroupExchange's group-done notices (see the module's docstring)."""

    if TYPE_CHECKING:  # what GroupExchange provides
        run_id: str
        numel: int
        shard_fetch: bool
        highest_round: dict[str, int]
        _rounds: dict[RoundId, GroupRound | ShardedRound]
        _wakes: dict[RoundId, asyncio.Event]
        _settled: OrderedDict[RoundId, bool]
        _lists: OrderedDict[tuple[str, int], frozenset[str]]
        _on_notice: set[RoundId]
        _reject: Callable[[str, str, str], None]
        _offer: Callable[[str, int, str], object] | None
        _fetch: Callable[..., Awaitable[bytes | None]] | None
        _applied_seq: Callable[[str], int] | None
        _on_update: Callable[[GroupUpdate], bool] | None
        _on_event: Callable[..., None] | None

        async def _hold(self, update: GroupUpdate) -> None: ...
        def _spawn(self, coro: Any) -> None: ...
        def candidate(self, group_key: str, seq: int, holder: str) -> None: ...
        async def _assembled(
            self, uid: tuple[str, int], holders: Sequence[str]
        ) -> GroupUpdate | None: ...

    applied_variant: Callable[[str, int], str | None] | None = None
    """(group key, seq) -> the digest of the variant this replica applied under that id, or
    None (set by the node: merge.group_pipeline's variants)."""

    @functools.cached_property
    def variant_fetches(self) -> VariantFetches:
        """The variants of rounds this node fetched because a notice named them."""
        return VariantFetches()

    async def rpc_done(self, info: Any, reader: Any, writer: Any) -> None:
        """A member's signed notice that it completed a round (dht.group_notice: refused and
        counted unless signed by its sender, a member of the round and of this node's list of
        its group, and at most one round past the highest this node knows): fetched from it if
        this node's own round needs the update, offered to the gossip if this node merges it
        as any replica, ignored if this node holds it (dht.grouping_done.done_action)."""
        sender = str(info.peer_id)
        notice = await self._take(
            "group_done", sender, reader, notice_max_bytes(), decode_notice, counted=False
        )
        if notice is None:
            return
        done = notice.done
        if done.round_id in self._on_notice and done.variant is None:
            return  # another member's notice of the round is being acted on
        reason = notice_refusal(
            notice,
            sender,
            self.run_id,
            in_group=member_check(self.run_id, done.group_key),
            members=self._lists.get((done.group_key, done.epoch)),
            highest_round=self._highest_known(done.group_key),
        )
        if reason is not None:
            self._reject(f"group_done_{reason}", sender, f"{done.round_id}")
            return
        if done.variant is not None:
            self._watch_variant(sender, done)
        if done.round_id in self._on_notice:
            return  # another member's notice of the round is being acted on
        self._on_notice.add(done.round_id)  # at most one per round this node runs or ran
        self._spawn(self._on_done(sender, done))  # a wait and a fetch outlast the stream

    def _highest_known(self, group_key: str) -> int:
        """The highest round of a group this node has evidence of other than notices: its
        own rounds and verified parts and pieces (any group: they count rounds alike), and
        the group's updates its replica applied (seq = round + 1: a group ahead of this
        node's is followed one round at a time, by updates co-signed by its members)."""
        own = max(self.highest_round.values(), default=-1)
        applied = self._applied_seq(group_key) - 1 if self._applied_seq is not None else -1
        return max(own, applied)

    async def _on_done(self, sender: str, done: Done) -> None:
        try:
            await self._act_on_done(sender, done)
        finally:
            self._on_notice.discard(done.round_id)

    async def _act_on_done(self, sender: str, done: Done) -> None:
        rid = done.round_id
        waited = False
        while True:
            member = self._rounds.get(rid)
            action = done_action(
                member, done, self._settled.get(rid), time.monotonic(), waited=waited
            )
            if not isinstance(action, float):
                break
            await asyncio.sleep(max(action - time.monotonic(), 0.0))
            waited = True
        if action == "offer" and self.shard_fetch:  # a candidate of the next fetch round
            self.candidate(done.group_key, done.seq, sender)
        elif action == "offer" and self._offer is not None:
            self._offer(done.group_key, done.seq, sender)
        elif action == "adopt" and member is not None and self._fetch is not None:
            update = await self._fetch_update(sender, done)
            if update is None or member.done:
                return
            if _round_id(update) == rid and member.adopt(update):  # counted as update_fetched
                self._wakes[rid].set()
            else:
                self._reject("group_update_refused", sender, "an update this round cannot take")

    async def _fetch_update(self, sender: str, done: Done, **cause: str) -> GroupUpdate | None:
        """The round's update as `sender` serves it, decoded (None: not served, or malformed
        and counted against the sender)."""
        assert self._fetch is not None
        data = await self._fetch(sender, done.group_key, done.seq, **cause)
        if data is None:  # not served whole: from its shards' holders (Session 28)
            return await self._assembled((done.group_key, done.seq), (sender,))
        try:
            return decode_update(data, self.numel)
        except GroupMessageError as exc:
            self._reject(f"group_update_{exc.reason}", sender, str(exc))
            return None

    def _watch_variant(self, sender: str, done: Done) -> None:
        """Compares the variant a notice names with the one this node holds of the round (its
        own round's update, or the one its replica applied), once it holds one, and fetches
        the named one where they differ (dht.variant_fetches: bounded, counted)."""
        assert done.variant is not None
        watch = self.variant_fetches.watch(done.round_id, done.variant)
        if watch == "capped":
            self._reject("group_done_variants_capped", sender, f"{done.round_id}")
        if watch == "ok":
            self._spawn(self._check_variant(sender, done, done.variant))

    async def _check_variant(self, sender: str, done: Done, named: str) -> None:
        rid, book = done.round_id, self.variant_fetches
        try:
            until = time.monotonic() + VARIANT_WAIT_S
            while (decision := book.decide(rid, self._held_variant(rid), named)) == "wait":
                if time.monotonic() >= until:
                    return
                await asyncio.sleep(VARIANT_POLL_S)
            if decision == "capped":
                self._reject("group_done_variants_capped", sender, f"{rid}")
            if decision == "fetch":
                await self._fetch_variant(sender, done, named)
        finally:
            book.unwatch(rid, named)

    def _held_variant(self, rid: RoundId) -> str | None:
        """The digest of the variant of `rid` this node holds: its own round's update while
        the round is here, else the one its replica applied (None: none yet)."""
        member = self._rounds.get(rid)
        if member is not None and member.done and isinstance(member.outcome, GroupUpdate):
            return GroupVariant.of(member.outcome).digest
        if member is not None and isinstance(member.outcome, ShardHolding):  # folded (29)
            return GroupVariant.of(member.outcome.fields).digest
        if self.applied_variant is None:
            return None
        return self.applied_variant(rid[0], rid[2] + 1)

    async def _fetch_variant(self, sender: str, done: Done, named: str) -> None:
        """Another variant of a round this node holds one of, from the notifier that named
        it: merged as any replica's (the merge refuses it as a second variant and makes the
        proof, which goes on: node.network_swarm), or counted against the notifier."""
        if self._fetch is None or self._on_update is None:
            return
        update = await self._fetch_update(sender, done, cause="variant")
        if update is None:
            return
        served = GroupVariant.of(update).digest
        reason = served_refusal(done.round_id, named, _round_id(update), served)
        if reason is not None:
            self._reject(reason, sender, f"{done.round_id} named {named}, served {served}")
            return
        if self._on_event is not None:
            self._on_event("group_variant_fetched", author=done.group_key, seq=done.seq,
                           peer_id=sender, variant=named)  # fmt: skip
        loop = asyncio.get_running_loop()
        if await loop.run_in_executor(None, self._on_update, update):
            await self._hold(update)  # applied here after all (nothing was, in the meantime)


def push_targets(
    member: GroupRound | ShardedRound, update: GroupUpdate, live: Iterable[str]
) -> list[str]:
    """Where this member sends its round's group-done notice: every other member (one that
    lost a member the completer had the co-signature of fetches and adopts it) and its share
    of the live peers outside the group: the k-th of them (sorted) by the ((k + c) mod n)-th
    of the n included members for c < COPIES, so each outsider hears of it from COPIES
    members (one dying after the round loses it nobody) and fetches it once."""
    included = [h.author for h in update.contributions]
    outside = sorted(set(live) - member.members)
    mine = []
    if member.me in included:
        n, i = len(included), included.index(member.me)
        mine = [p for k, p in enumerate(outside) if any((k + c) % n == i for c in range(COPIES))]
    return member.others() + mine


def _round_id(update: GroupUpdate) -> RoundId:
    head = update.head
    return (head.group_key, head.epoch, head.round)
