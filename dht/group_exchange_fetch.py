"""The shard fetch over the network (`--group-shard-fetch`; docs/scale.md, Session 17): the
`group-fetch` and `group-slice` streams and the coroutine that runs one member's fetch round
(merge.shard_member `MemberRound`, driven from signed messages: dht.shard_fetch_wire). A mixin
of dht.group_exchange.GroupExchange, which holds the streams' plumbing; the candidates and
their fallback are dht.group_exchange_candidates', the slices dht.group_exchange_slices', a
round's inbox dht.shard_fetch_inbox's, a left-out member's realignment from its group's class
dht.group_exchange_realign's (docs/scale.md, Session 22).

A member whose group round completed with it included runs a fetch round with the round's
other included members once its group's update is applied here: each proposes the other
groups' updates it was told of (`group-done` notices: candidates, no longer handed to the
gossip at once), the round merges those all proposed (merge.shard_fetch `compose`), each
member fetches the shards its slice needs from a holder (`group-slice`), and the members
exchange part matrices and slices of the weighted sums; every member applies the round as
one step. Anything wrong ends the round with nothing applied: every member fetches the ids
all proposed whole (the gossip's stream) and applies them in id order; a candidate not applied
`FALLBACK_ROUNDS` x the group wait after its notice is handed over whatever happened
(dht.shard_fetch_hold). Every refusal is counted
(`group_fetch_<reason>`), never raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from dht.budget import StreamLimits
from dht.group_exchange_assembly import AssemblyExchange
from dht.group_exchange_candidates import FetchCandidates, with_own
from dht.group_exchange_realign import ClassRealignment
from dht.group_exchange_slices import SLICE_LIMITS, SliceExchange
from dht.grouping import member_check
from dht.grouping_wire import GroupMessageError, RoundId
from dht.shard_fetch_bodies import NAMED_HOLDERS
from dht.shard_fetch_hold import HoldBook
from dht.shard_fetch_inbox import Fallback, Inbox
from dht.shard_fetch_wire import (
    FetchMessage,
    decode_fetch,
    fetch_max_bytes,
    part_message,
    part_of,
    proposal_body,
    proposal_of,
    states_body,
    states_of,
)
from merge.group_pipeline import GroupMerge
from merge.group_update import GroupUpdate
from merge.result import MergeResult
from merge.shard_fetch import (
    MAX_CANDIDATES,
    Proposal,
    StateBlock,
    UpdateId,
    agreed,
    compose,
    left_out,
    state_blocks,
    state_gap,
)
from merge.shard_holders import ShardHolding
from merge.shard_member import MemberRound
from merge.shard_part import variants_digest
from merge.shard_round import state_tensors
from merge.shard_states import resolved, states_wanted

if TYPE_CHECKING:
    from dht.network import SwarmNetwork
    from merge.identity import Identity

logger = logging.getLogger(__name__)

FETCH_LIMITS = StreamLimits(rate_per_s=8.0, burst=32.0, max_in_flight=4, deadline_s=60.0)
"""Fetch-round messages a peer may send: three per round from each member."""
MAX_HELD_FETCH_ROUNDS = 4
"""Fetch rounds whose messages are held before this node opens them."""
POLL_S = 0.05
STATE_CHECKS = ("gram_wrong_state", "sums_direction")
"""MemberRound's failures that replicas of one applied set in other orders earn as well as a
liar: counted as a state that differs (`num_state_differs`), never against the peer."""

T = TypeVar("T")


class FetchExchange(FetchCandidates, SliceExchange, AssemblyExchange, ClassRealignment):
    """GroupExchange's shard fetch (see the module's docstring)."""

    if TYPE_CHECKING:  # what GroupExchange provides
        network: SwarmNetwork
        identity: Identity
        run_id: str
        numel: int
        _is_alive: Callable[[str], bool]
        _reject: Callable[[str, str, str], None]

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
        self._holdbook = HoldBook()
        """Which other groups' updates wait for fetch rounds, and why each one goes."""
        self._holdbook.holding = self.shard_fetch  # until `stop_holding`
        self._timers: set[UpdateId] = set()
        """Candidates whose hand-over is timed (`_hand_over_when_due`)."""
        self.fetch_wait_s = 30.0
        """The group wait of this node's last round: a fetch round's deadlines."""
        self._candidates: OrderedDict[UpdateId, tuple[str, ...]] = OrderedDict()
        self._keys: OrderedDict[str, None] = OrderedDict()
        """Other group keys a notice was heard from (what a round's collection waits for)."""
        self._kept: OrderedDict[UpdateId, GroupUpdate] = OrderedDict()
        self._holdings: OrderedDict[UpdateId, ShardHolding] = OrderedDict()
        """Some shards of group updates this node holds to serve (Session 28)."""
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
        self.num_assembled = 0
        self.num_slices_held = 0
        """Slices a fetch round took from shards held here (a folded round's own: Session 28)."""
        """Whole updates put together from their shards' holders (Session 28)."""
        self.num_state_differs = 0
        """Fetch rounds that fell back because members' replicas were at other states (at
        the proposals, or at the part or sums checks): nobody's fault, no refusal counted."""
        self._init_realign()

    async def register_fetch(self) -> None:
        if self.shard_fetch:
            await self.network.add_handler("group-fetch", self.rpc_fetch, FETCH_LIMITS)
            await self.network.add_handler("group-slice", self.rpc_slice, SLICE_LIMITS)

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

    # ---- one fetch round --------------------------------------------------------------------

    def start_fetch_round(self, update: GroupUpdate, own: bool = False) -> None:
        """After this node's group round completed with it included: its fetch round; `own`:
        the round was folded (--group-fold), its update one more candidate of this round,
        held by its included members (each holds some shards: merge.shard_holders)."""
        members = sorted(h.author for h in update.contributions)
        if self.shard_fetch and self.identity.peer_id in members:
            if own:
                uid = (update.head.group_key, update.seq)
                self._holdbook.noticed(uid, time.monotonic(), self.fetch_wait_s)
                self._add_candidate(uid, members)
            self._spawn(self._fetch_round(update, members, own))

    async def _fetch_round(
        self, update: GroupUpdate, members: list[str], own: bool = False
    ) -> None:
        head = update.head
        rid = (head.group_key, head.epoch, head.round)
        inbox = self._held_inboxes.pop(rid, None) or Inbox()
        self._inboxes[rid] = inbox
        try:
            async with self._one_round:
                self._holdbook.round_opened(time.monotonic())
                try:
                    await self._one_fetch_round(rid, update, members, inbox, own)
                finally:
                    self._holdbook.round_closed()
        finally:
            self._inboxes.pop(rid, None)

    async def _one_fetch_round(
        self, rid: RoundId, update: GroupUpdate, members: list[str], inbox: Inbox, own: bool
    ) -> None:
        started, ids, applied, in_order, sums = time.monotonic(), 0, 0, 0, 0
        reused = self.num_slices_reused
        try:
            ids, applied, sums = await self._run_fetch(rid, update, members, inbox, own)
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
            if self._waits_for_class(outcome):
                inbox.waits_for_class = True  # its ids stay candidates (handed over in time)
            else:
                # folded: the own update assembled and applied in order whatever failed
                own_uid = (rid[0], update.seq) if own else None
                ids_back, holders = with_own(inbox.agreed, inbox.holders, own_uid, members)
                in_order = await self._fall_back(ids_back, holders, outcome)
        if self._on_event is not None:
            self._on_event(
                "shard_round", group_key=rid[0], epoch=rid[1], round=rid[2],
                members=len(members), outcome=outcome, ids=ids, applied=applied,
                candidates=inbox.proposed, seconds=round(time.monotonic() - started, 3),
                state_gap=inbox.state_gap, fallback_in_order=in_order,
                slices_reused=self.num_slices_reused - reused,
                realigned_from=inbox.realigned_from, realign_loaded=inbox.realign_loaded,
                waits_for_class=inbox.waits_for_class, num_bases=inbox.num_bases,
                class_size=inbox.class_size, sums=sums,
            )  # fmt: skip

    async def _run_fetch(
        self, rid: RoundId, update: GroupUpdate, members: list[str], inbox: Inbox, own: bool
    ) -> tuple[int, int, int]:
        """(updates in the round's set, updates applied, weighted sums gathered: one a stretch
        between Delayed Nesterov folds, session 27); Fallback when it falls back. `own`: the
        own update is a candidate (folded), not applied before the round."""
        if len(members) < 2:
            raise Fallback("alone")
        wait_s, me = self.fetch_wait_s, self.identity.peer_id
        others = [m for m in members if m != me]
        if not own:
            own_uid = (rid[0], update.seq)
            await self._until(lambda: self._applied(own_uid), wait_s, "own_not_applied")
        realigning = self._realign_from_class(members, inbox)
        await self._collect(update.seq, wait_s / 2)
        if realigning is not None:
            await self._realigned(realigning, inbox, wait_s / 2)
        loop = asyncio.get_running_loop()
        base, states = await loop.run_in_executor(None, self._state, len(members))
        proposal = self._proposal(base, states)
        inbox.proposed = [f"{key}#{seq}" for key, seq in proposal.candidates]
        await self._broadcast(rid, others, "propose", proposal_body(proposal), ())
        got = await inbox.wait("propose", others, time.monotonic() + wait_s)
        proposals = {me: proposal} | {s: self._parsed(proposal_of, m) for s, m in got.items()}
        proposals = await self._with_states(rid, proposals, inbox, wait_s)
        inbox.agreed, inbox.holders = agreed(proposals)
        inbox.state_gap = state_gap([proposals[m].states for m in sorted(members)])
        inbox.num_bases = len({p.base for p in proposals.values()})
        composition = compose(proposals, members)
        inbox.class_size = 0 if isinstance(composition, str) else len(composition.members)
        if isinstance(composition, str):
            self.num_state_differs += composition == "state_differs"
            raise Fallback(composition)
        out = left_out(composition, proposals, me)
        if out is not None:  # the round runs without this member: it falls back alone
            self.num_state_differs += out == "left_out_state"
            self.class_realign.left_out(composition.members, members, out)  # at the next round
            raise Fallback(out)
        self.class_realign.aligned()
        if not composition.ids:
            return 0, 0, 0
        inbox.agreed, inbox.holders = composition.ids, dict(composition.holders)
        ours = list(composition.members)
        member, variants = await self._fetch_slices(composition, ours)
        others = [m for m in ours if m != me]
        results = await self._merge_round(rid, member, variants, others, inbox)
        for result in results:
            if self._on_merged is not None:
                self._on_merged(result)
        for decision in member.plan.decisions if member.plan is not None else ():
            self._taken(decision.incoming.uid)
        plan = member.plan
        # nothing deferred since session 27 (decided past every fold) unless the plan would ask
        # for more than MAX_SUMS sums: what is past its cut is fetched whole, in id order
        deferred = [inc.uid for inc in plan.deferred] if plan is not None else []
        inbox.in_order = await self._apply_in_order(deferred, composition.holders)
        sums = len(plan.combos) if plan is not None else 0
        return len(composition.ids), sum(r.accepted for r in results), sums

    async def _with_states(
        self, rid: RoundId, proposals: dict[str, Proposal], inbox: Inbox, wait_s: float
    ) -> dict[str, Proposal]:
        """The proposals with their state blocks in hand: the members whose digest differs
        from this one's send each other their blocks (merge.shard_states, session 28)."""
        me = self.identity.peer_id
        wanted, sent = states_wanted(proposals, me), {}
        if wanted:
            await self._broadcast(rid, wanted, "states", states_body(proposals[me].states), ())
            got = await inbox.wait("states", wanted, time.monotonic() + wait_s)
            sent = {s: self._parsed(states_of, m) for s, m in got.items()}
        out, wrong = resolved(proposals, me, sent)
        for sender in wrong:
            self._reject("group_fetch_states_digest", sender, "blocks not of its digest")
        return out

    async def _abort(self, rid: RoundId, others: list[str], reason: str) -> None:
        with contextlib.suppress(Fallback):
            await self._broadcast(rid, others, "abort", {"reason": reason[:64]}, ())

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
        """This member's word: its base and state, the candidates not applied here (sorted, at
        most MAX_CANDIDATES), each with the first NAMED_HOLDERS holders it heard of (the
        round fetches from the union its class names: dht.shard_fetch_bodies)."""
        wanted = [uid for uid in self._candidates if not self._applied(uid)]
        ids = sorted(wanted)[:MAX_CANDIDATES]
        named = {uid: self._candidates[uid][:NAMED_HOLDERS] for uid in ids}
        return Proposal(base, named, states)

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
        await self._broadcast(rid, others, "part", *part_message(part, variants))
        deadline, ours = time.monotonic() + self.fetch_wait_s, variants_digest(variants)
        for sender, message in (await inbox.wait("part", others, deadline)).items():
            gram, theirs = self._parsed(part_of, message)
            if theirs != ours:
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
