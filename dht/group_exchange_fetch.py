"""The shard fetch over the network (`--group-shard-fetch`; docs/scale.md, Session 17): the
`group-fetch` and `group-slice` streams and the coroutine that runs one member's fetch round
(merge.shard_member `MemberRound`, driven from signed messages: dht.shard_fetch_wire). A mixin
of dht.group_exchange.GroupExchange, which holds the streams' plumbing.

A member whose group round completed with it included runs a fetch round with the round's
other included members once its group's update is applied here: each proposes the other
groups' updates it was told of (`group-done` notices: candidates, no longer handed to the
gossip at once), the round merges those all proposed (merge.shard_fetch `compose`), each
member fetches the shards its slice needs from a holder (`group-slice`), and the members
exchange part matrices and slices of the weighted sums; every member applies the round as
one step. Anything wrong ends the round with nothing applied and hands every candidate to the
gossip (the whole fetch); a candidate not applied `FALLBACK_ROUNDS` x the group wait after
its notice is handed over whatever happened. Every refusal is counted
(`group_fetch_<reason>`), never raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from dht.budget import StreamLimits
from dht.gossip_groups import is_group_key, parse_fetched
from dht.grouping import member_check
from dht.grouping_round import GroupMessageError, RoundId
from dht.shard_fetch_wire import (
    FetchMessage,
    decode_fetch,
    decode_slice,
    fetch_max_bytes,
    parse_slice_request,
    part_body,
    part_of,
    proposal_body,
    proposal_of,
    slice_answer,
    slice_max_bytes,
    slice_request,
)
from dht.swarm_config import REQUEST_READ_TIMEOUT_S
from dht.transport import TransportError, receive_blob, send_blob, send_refusal
from merge.group_pipeline import GroupMerge
from merge.group_plan import shard_bounds
from merge.group_update import GroupUpdate
from merge.result import MergeResult
from merge.shard_fetch import (
    MAX_CANDIDATES,
    MAX_HOLDERS,
    Composition,
    Proposal,
    StateBlock,
    UpdateId,
    agreed,
    compose,
    cut_slice,
    incoming_of_headers,
    left_out,
    pieces_problem,
    state_blocks,
    state_gap,
    variant_digest,
    wanted_shards,
)
from merge.shard_member import MemberRound
from merge.shard_round import Incoming, ShardRound, state_tensors

if TYPE_CHECKING:
    from dht.network import SwarmNetwork
    from merge.identity import Identity

logger = logging.getLogger(__name__)

FETCH_LIMITS = StreamLimits(rate_per_s=8.0, burst=32.0, max_in_flight=4, deadline_s=60.0)
"""Fetch-round messages a peer may send: three per round from each member."""
SLICE_LIMITS = StreamLimits(rate_per_s=8.0, burst=32.0, max_in_flight=4, deadline_s=60.0)
"""Slice requests a peer may make: one per update of a fetch round, from each member."""
FALLBACK_ROUNDS = 3.0
"""A candidate not applied this many group waits after its notice goes to the gossip."""
UNNOTICED_ROUNDS = 1.0
"""Group waits the gossip holds back another group's update no notice named (`held_back`)."""
MAX_KEPT_UPDATES = 4
"""Group updates this node completed that it keeps whole to serve slices of."""
MAX_HELD_FETCH_ROUNDS = 4
"""Fetch rounds whose messages are held before this node opens them."""
KEPT_SLICE_MODELS = 2
"""Fetched slices kept for a later round, in model sizes of values (session 18: an update
deferred past a fold is fetched again by the next round, same members, same slice)."""
MAX_KNOWN_KEYS = 64
POLL_S = 0.05
STATE_CHECKS = ("gram_wrong_state", "sums_direction")
"""MemberRound's failures that replicas of one applied set in other orders earn as well as a
liar: counted as a state that differs (`num_state_differs`), never against the peer."""

T = TypeVar("T")


class Fallback(Exception):
    """A fetch round ends with nothing applied (its reason)."""


class Inbox:
    """One fetch round's messages by kind and sender (one each), and a wake for the waiter."""

    def __init__(self) -> None:
        self.messages: dict[str, dict[str, FetchMessage]] = {}
        self.wake = asyncio.Event()
        self.proposed: list[str] = []
        """The ids this member proposed (`key#seq`), for its `shard_round` event."""
        self.agreed: tuple[UpdateId, ...] = ()
        """The ids every member proposed (once all proposals are in): what the members
        fall back on alike, fetched whole and applied in this order."""
        self.holders: dict[UpdateId, tuple[str, ...]] = {}
        self.state_gap: float | None = None
        """How far the members' replicas lay apart (merge.shard_fetch `state_gap`)."""
        self.in_order = 0
        """Updates this round applied whole in id order (deferred past its fold)."""

    def put(self, message: FetchMessage) -> None:
        self.messages.setdefault(message.kind, {}).setdefault(message.sender, message)
        self.wake.set()

    def size(self) -> int:
        return sum(len(m) for m in self.messages.values())

    async def wait(self, kind: str, senders: list[str], deadline: float) -> dict[str, FetchMessage]:
        """Each of `senders`' `kind` message, waited for until `deadline` (Fallback), or until
        one of them says it fell back (`abort`)."""
        while True:
            if any(s in self.messages.get("abort", {}) for s in senders):
                raise Fallback("aborted")
            got = self.messages.get(kind, {})
            if all(s in got for s in senders):
                return {s: got[s] for s in senders}
            left = deadline - time.monotonic()
            if left <= 0:
                raise Fallback(f"{kind}_missing")
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), timeout=left)


class FetchExchange:
    """GroupExchange's shard fetch (see the module's docstring)."""

    if TYPE_CHECKING:  # what GroupExchange provides
        network: SwarmNetwork
        identity: Identity
        run_id: str
        numel: int
        _is_alive: Callable[[str], bool]
        _reject: Callable[[str, str, str], None]
        _offer: Callable[[str, int, str], object] | None
        _fetch: Callable[[str, str, int], Awaitable[bytes | None]] | None
        _on_update: Callable[[GroupUpdate], bool] | None

        async def _hold(self, update: GroupUpdate) -> None: ...

        async def _take(
            self,
            name: str,
            sender: str,
            reader: Any,
            max_bytes: int,
            decode: Callable[[bytes], T],
            counted: bool = True,
        ) -> T | None: ...
        def _received(self, kind: str, sender: str, num_bytes: int) -> None: ...
        async def _send(self, peer: str, name: str, blob: bytes, timeout_s: float) -> bool: ...
        def _spawn(self, coro: Any) -> None: ...

    def _init_fetch(
        self,
        merge: GroupMerge | None,
        on_event: Callable[..., None] | None,
        on_merged: Callable[[MergeResult], None] | None,
    ) -> None:
        self.shard_fetch = merge is not None
        """--group-shard-fetch: other groups' updates by slices (with `merge`, the group merge
        of this node's pipeline)."""
        self._merge = merge
        self._on_event = on_event
        self._on_merged = on_merged
        self._holds_back = self.shard_fetch
        """Whether other groups' updates wait for fetch rounds (until `stop_holding`)."""
        self.fetch_wait_s = 30.0
        """The group wait of this node's last round: a fetch round's deadlines."""
        self._candidates: OrderedDict[UpdateId, tuple[str, ...]] = OrderedDict()
        self._keys: OrderedDict[str, None] = OrderedDict()
        """Other group keys a notice was heard from (what a round's collection waits for)."""
        self._kept: OrderedDict[UpdateId, GroupUpdate] = OrderedDict()
        self._first_wanted: OrderedDict[UpdateId, float] = OrderedDict()
        """When the gossip first wanted each other group's update (`held_back`)."""
        self._released: OrderedDict[UpdateId, None] = OrderedDict()
        """Updates handed to the gossip's whole fetch (a fallback, or their time out)."""
        self._own_keys: OrderedDict[str, None] = OrderedDict()
        """This node's group keys (its rounds'): their updates are never held back."""
        self._inboxes: dict[RoundId, Inbox] = {}
        self._held_inboxes: OrderedDict[RoundId, Inbox] = OrderedDict()
        self._one_round = asyncio.Lock()
        """One fetch round at a time here: a round's base must not move under it by another
        round's step or fallback (session 17's rounds overlapped when one waited out a
        deadline)."""
        self._slices: OrderedDict[tuple[UpdateId, int, int], tuple[GroupUpdate, torch.Tensor]] = (
            OrderedDict()
        )
        """Checked slices by (update, start, end), kept (bounded) for the next round."""
        self.num_slices_reused = 0
        self.num_state_differs = 0
        """Fetch rounds that fell back because members' replicas were at other states (at
        the proposals, or at the part or sums checks): nobody's fault, no refusal counted."""

    async def register_fetch(self) -> None:
        if self.shard_fetch:
            await self.network.add_handler("group-fetch", self.rpc_fetch, FETCH_LIMITS)
            await self.network.add_handler("group-slice", self.rpc_slice, SLICE_LIMITS)

    # ---- candidates and kept updates --------------------------------------------------------

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

    def keep(self, update: GroupUpdate) -> None:
        """A group update this node completed: kept whole (bounded) to serve its slices."""
        if not self.shard_fetch:
            return
        uid = (update.head.group_key, update.seq)
        self._kept[uid] = update
        while len(self._kept) > MAX_KEPT_UPDATES:
            self._kept.popitem(last=False)

    # ---- serving ----------------------------------------------------------------------------

    async def rpc_fetch(self, info: Any, reader: Any, writer: Any) -> None:
        """A fetch-round message: signed by its sender, of this run; taken by the round if it
        runs here, else held (bounded) for a live peer inside the round's group."""
        sender = str(info.peer_id)

        def decode(blob: bytes) -> FetchMessage:
            message = decode_fetch(blob, self.numel)
            if message.sender != sender:
                raise GroupMessageError("wrong_sender", "a fetch message relayed")
            if message.run_id != self.run_id:
                raise GroupMessageError("wrong_run", f"of run {message.run_id!r}")
            if not message.verified():
                raise GroupMessageError("bad_signature", "a fetch message not signed by its sender")
            return message

        message = await self._take(
            "group_fetch", sender, reader, fetch_max_bytes(self.numel), decode
        )  # its bytes counted as received (`fetch`), as parts and pieces are
        if message is None:
            return
        rid = message.round_id
        inbox = self._inboxes.get(rid)
        if inbox is None:
            if not member_check(self.run_id, rid[0])(sender) or not self._is_alive(sender):
                self._reject("group_fetch_not_a_member", sender, f"{rid}")
                return
            inbox = self._held_inboxes.get(rid) or Inbox()
            self._held_inboxes[rid] = inbox
            while len(self._held_inboxes) > MAX_HELD_FETCH_ROUNDS:
                self._held_inboxes.popitem(last=False)
        if inbox.size() < 3 * 64:
            inbox.put(message)

    async def rpc_slice(self, info: Any, reader: Any, writer: Any) -> None:
        """Shards of an update this node kept, with its fields; a refusal when not kept."""
        sender = str(info.peer_id)
        try:
            blob = await asyncio.wait_for(
                receive_blob(reader, max_bytes=4096), REQUEST_READ_TIMEOUT_S
            )
            uid, start, end = parse_slice_request(blob, self.numel)
            update = self._kept.get(uid)
            if update is None:
                await send_refusal(writer, "not kept")
                return
            answer = await asyncio.to_thread(slice_answer, update, start, end)
            await send_blob(writer, answer)
        except GroupMessageError as exc:
            self._reject(f"group_slice_{exc.reason}", sender, str(exc))
        except (TransportError, OSError, TimeoutError) as exc:
            logger.debug("slice request from %s failed: %r", sender, exc)

    # ---- one fetch round --------------------------------------------------------------------

    def start_fetch_round(self, update: GroupUpdate) -> None:
        """After this node's group round completed with it included: its fetch round."""
        members = sorted(h.author for h in update.contributions)
        if self.shard_fetch and self.identity.peer_id in members:
            self._spawn(self._fetch_round(update, members))

    async def _fetch_round(self, update: GroupUpdate, members: list[str]) -> None:
        head = update.head
        rid = (head.group_key, head.epoch, head.round)
        inbox = self._held_inboxes.pop(rid, None) or Inbox()
        self._inboxes[rid] = inbox
        try:
            async with self._one_round:
                await self._one_fetch_round(rid, update, members, inbox)
        finally:
            self._inboxes.pop(rid, None)

    async def _one_fetch_round(
        self, rid: RoundId, update: GroupUpdate, members: list[str], inbox: Inbox
    ) -> None:
        started, ids, applied, in_order = time.monotonic(), 0, 0, 0
        reused = self.num_slices_reused
        try:
            ids, applied = await self._run_fetch(rid, update, members, inbox)
            outcome = "applied" if ids else "empty"
            in_order = inbox.in_order
        except Fallback as exc:
            outcome = str(exc)
        except Exception as exc:  # a bug must not cost the node: the whole fetch
            logger.warning("fetch round %s failed: %r", rid, exc)
            outcome = "error"
        if outcome not in ("applied", "empty"):
            if outcome not in ("alone", "aborted"):  # the others stop waiting for this one
                others = [m for m in members if m != self.identity.peer_id]
                self._spawn(self._abort(rid, others, outcome))
            in_order = await self._fall_back(inbox.agreed, inbox.holders)
        if self._on_event is not None:
            self._on_event(
                "shard_round", group_key=rid[0], epoch=rid[1], round=rid[2],
                members=len(members), outcome=outcome, ids=ids, applied=applied,
                candidates=inbox.proposed, seconds=round(time.monotonic() - started, 3),
                state_gap=inbox.state_gap, fallback_in_order=in_order,
                slices_reused=self.num_slices_reused - reused,
            )  # fmt: skip

    async def _run_fetch(
        self, rid: RoundId, update: GroupUpdate, members: list[str], inbox: Inbox
    ) -> tuple[int, int]:
        """(updates in the round's set, updates applied); Fallback when it falls back."""
        if len(members) < 2:
            raise Fallback("alone")
        wait_s, me = self.fetch_wait_s, self.identity.peer_id
        others = [m for m in members if m != me]
        await self._until(lambda: self._applied((rid[0], update.seq)), wait_s, "own_not_applied")
        await self._collect(update.seq, wait_s / 2)
        loop = asyncio.get_running_loop()
        base, states = await loop.run_in_executor(None, self._state, len(members))
        proposal = self._proposal(base, states)
        inbox.proposed = [f"{key}#{seq}" for key, seq in proposal.candidates]
        await self._broadcast(rid, others, "propose", proposal_body(proposal), ())
        got = await inbox.wait("propose", others, time.monotonic() + wait_s)
        proposals = {me: proposal} | {s: self._parsed(proposal_of, m) for s, m in got.items()}
        inbox.agreed, inbox.holders = agreed(proposals)
        inbox.state_gap = state_gap([proposals[m].states for m in sorted(members)])
        composition = compose(proposals, members)
        if isinstance(composition, str):
            self.num_state_differs += composition == "state_differs"
            raise Fallback(composition)
        out = left_out(composition, proposals, me)
        if out is not None:  # the round runs without this member: it falls back alone
            self.num_state_differs += out == "left_out_state"
            raise Fallback(out)
        if not composition.ids:
            return 0, 0
        inbox.agreed, inbox.holders = composition.ids, dict(composition.holders)
        ours = list(composition.members)
        member, variants = await self._fetch_slices(composition, ours)
        others = [m for m in ours if m != me]
        results = await self._merge_round(rid, member, variants, others, inbox)
        for result in results:
            if self._on_merged is not None:
                self._on_merged(result)
        for decision in member.plan.decisions if member.plan is not None else ():
            self._candidates.pop(decision.incoming.uid, None)
        deferred = [inc.uid for inc in member.plan.deferred] if member.plan is not None else []
        inbox.in_order = await self._apply_in_order(deferred, composition.holders)
        return len(composition.ids), sum(r.accepted for r in results)

    async def _abort(self, rid: RoundId, others: list[str], reason: str) -> None:
        with contextlib.suppress(Fallback):
            await self._broadcast(rid, others, "abort", {"reason": reason[:64]}, ())

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

    async def _until(self, done: Callable[[], bool], bound_s: float, reason: str) -> None:
        deadline = time.monotonic() + bound_s
        while not done():
            if time.monotonic() >= deadline:
                raise Fallback(reason)
            await asyncio.sleep(POLL_S)

    async def _collect(self, seq: int, bound_s: float) -> None:
        """Until a candidate of `seq` (this round's) is in from every other group heard of,
        or `bound_s`: the others' updates of the same round join this fetch round."""
        deadline = time.monotonic() + bound_s

        def complete() -> bool:
            have = {key for key, s in self._candidates if s >= seq}
            return all(key in have for key in self._keys)

        while not complete() and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)

    def _state(self, num_members: int) -> tuple[tuple[int, str], tuple[StateBlock, ...]]:
        """The replica's base and its state blocks over the round's slices, read at one
        moment (under the replica's lock; off the loop: a pass over the state)."""
        assert self._merge is not None
        replica = self._merge.pipeline.replica
        with replica.lock:
            base = (replica.num_applied, replica.applied_digest())
            return base, state_blocks(state_tensors(replica), num_members)

    def _proposal(self, base: tuple[int, str], states: tuple[StateBlock, ...]) -> Proposal:
        wanted = [uid for uid in self._candidates if not self._applied(uid)]
        ids = sorted(wanted)[:MAX_CANDIDATES]
        return Proposal(base, {uid: self._candidates[uid] for uid in ids}, states)

    def _parsed(self, parse: Callable[[FetchMessage], T], message: FetchMessage) -> T:
        try:
            return parse(message)
        except GroupMessageError as exc:
            self._reject(f"group_fetch_{exc.reason}", message.sender, str(exc))
            raise Fallback(f"{message.kind}_refused") from None

    async def _broadcast(
        self,
        rid: RoundId,
        peers: list[str],
        kind: str,
        body: dict[str, Any],
        tensors: tuple[torch.Tensor, ...],
    ) -> None:
        message = FetchMessage(self.run_id, rid, kind, self.identity.peer_id, body, tensors)
        blob = message.signed(self.identity).to_bytes()
        sent = await asyncio.gather(
            *(self._send(p, "group-fetch", blob, self.fetch_wait_s) for p in peers)
        )
        if not all(sent):
            raise Fallback(f"{kind}_not_sent")

    async def _fetch_slices(
        self, composition: Composition, members: list[str]
    ) -> tuple[MemberRound, list[str]]:
        """This member's slice of each update of the set, checked; its `MemberRound` fed."""
        assert self._merge is not None
        me, numel = self.identity.peer_id, self.numel
        start, end = shard_bounds(numel, len(members))[members.index(me)]
        fetched = await asyncio.gather(
            *(self._fetch_one(uid, composition.holders[uid], start, end) for uid in composition.ids)
        )
        incoming: list[Incoming] = []
        for uid, (update, _) in zip(composition.ids, fetched, strict=True):
            key = uid[0]
            inc = incoming_of_headers(self._merge, update, numel, member_check(self.run_id, key))
            incoming.append(inc)
        member = MemberRound(ShardRound(self._merge), members, me, incoming)
        by_uid = {uid: piece for uid, (_, piece) in zip(composition.ids, fetched, strict=True)}
        for index in member.needs():
            if not member.fetched(index, by_uid[member.incoming[index].uid]):
                raise Fallback(member.failed or "slice_refused")
        variants = [variant_digest(update) for update, _ in fetched]
        return member, variants

    async def _fetch_one(
        self, uid: UpdateId, holders: tuple[str, ...], start: int, end: int
    ) -> tuple[GroupUpdate, torch.Tensor]:
        """The update's fields and this member's slice of it: kept from an earlier round, or
        from the first holder that serves shards that check; Fallback when none does."""
        key = (uid, start, end)
        kept = self._slices.get(key)
        if kept is not None:
            self.num_slices_reused += 1
            return kept
        for holder in holders:
            got = await self._ask_slice(holder, uid, start, end)
            if got is not None:
                self._keep_slice(key, got)
                return got
        raise Fallback("fetch_failed")

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
        self, holder: str, uid: UpdateId, start: int, end: int
    ) -> tuple[GroupUpdate, torch.Tensor] | None:
        numel = self.numel
        try:
            blob = await self.network.exchange(
                holder,
                "group-slice",
                slice_request(uid, start, end),
                max_bytes=slice_max_bytes(numel),
                timeout_s=self.fetch_wait_s,
            )
            update, pieces = decode_slice(blob, numel)
        except GroupMessageError as exc:
            self._reject(f"group_slice_{exc.reason}", holder, str(exc))
            return None
        except Exception as exc:  # refused, unreachable, timed out: the next holder
            logger.info("slice of %s from %s failed: %r", uid, holder, exc)
            return None
        self._received("slice", holder, len(blob))
        return self._checked_slice(holder, uid, update, pieces, start, end)

    def _checked_slice(
        self,
        holder: str,
        uid: UpdateId,
        update: GroupUpdate,
        pieces: Mapping[int, torch.Tensor],
        start: int,
        end: int,
    ) -> tuple[GroupUpdate, torch.Tensor] | None:
        in_group = member_check(self.run_id, uid[0])
        problem = "wrong_update" if (update.head.group_key, update.seq) != uid else None
        problem = problem or update.header_problem(in_group)
        wanted = [] if problem else wanted_shards(update.num_shards, self.numel, start, end)
        if problem is None and any(k not in pieces for k in wanted):
            problem = "shards_missing"
        problem = problem or pieces_problem(update, {k: pieces[k] for k in wanted}, self.numel)
        if problem is not None:
            self._reject(f"group_slice_{problem}", holder, f"{uid}")
            return None
        return update, cut_slice(update.num_shards, self.numel, pieces, start, end)

    def _refused(self, reason: str, sender: str, failed: str | None) -> None:
        """A part or sums that failed MemberRound's checks: counted against `sender` when its
        own message failed a check other than a state check (`STATE_CHECKS`, which an honest
        member on another state fails too). Not when this replica moved mid-round
        ("replica_moved": session 19's 16-node bench counted 2 against honest members)."""
        if failed is not None:
            problem, _, culprit = failed.partition(" from ")
            if culprit != sender:
                logger.info("fetch round: %s (not %s's message)", failed, sender)
                return
            if problem in STATE_CHECKS:
                self.num_state_differs += 1
                logger.info("fetch round: %s (a state that differs, not a refusal)", failed)
                return
        self._reject(reason, sender, f"{failed}")

    async def _merge_round(
        self,
        rid: RoundId,
        member: MemberRound,
        variants: list[str],
        others: list[str],
        inbox: Inbox,
    ) -> list[MergeResult]:
        """The part matrices, the plan, the sums, the round applied (Fallback otherwise)."""
        loop = asyncio.get_running_loop()
        part = await loop.run_in_executor(None, member.part)
        if part is None:
            raise Fallback(member.failed or "part")
        await self._broadcast(rid, others, "part", part_body(part, variants), ())
        deadline = time.monotonic() + self.fetch_wait_s
        for sender, message in (await inbox.wait("part", others, deadline)).items():
            gram, theirs = self._parsed(lambda m: part_of(m, len(variants)), message)
            if theirs != variants:
                raise Fallback("variant_differs")
            if not member.part_from(sender, gram):
                self._refused("group_fetch_part_refused", sender, member.failed)
                raise Fallback(member.failed or "part_refused")
        if await loop.run_in_executor(None, member.decide) is None:
            raise Fallback(member.failed or "undecided")
        sums = await loop.run_in_executor(None, member.sums)
        assert sums is not None
        await self._broadcast(rid, others, "sums", {}, tuple(sums))
        deadline = time.monotonic() + self.fetch_wait_s
        for sender, message in (await inbox.wait("sums", others, deadline)).items():
            if not member.sums_from(sender, message.tensors):
                self._refused("group_fetch_sums_refused", sender, member.failed)
                raise Fallback(member.failed or "sums_refused")
        results = await loop.run_in_executor(None, member.apply)
        if results is None:
            raise Fallback(member.failed or "not_applied")
        return results
