"""A learner group's round over the network: the `group-part`, `group-cosign` and
`group-update` streams, and the coroutine that drives one member's `GroupRound`.

Step 3 of docs/scale.md's wiring plan (the decisions are dht/grouping_round.py's, pure). On
the node's existing stream handlers (dht/network.py's `add_handler`, each within its
per-peer `StreamLimits`, as `notify` is): what a peer sends is untrusted and read within a
bound (`part_max_bytes`: the replica's fp32 size and a 4 KiB header); every refusal is
counted against the sender (`group_part_<reason>`, ...), never raised. Parts for a round this
node has not opened yet are held, bounded, and fed to the round when it opens: a member that
finished training first does not lose the others' parts (dht.group_exchange_early).

`group-done`, the notice a member that completed its round sends instead of the update, and
what a node does with one: dht.group_exchange_done. `group-update` (a pushed whole update)
is still served, for nodes of session 10.

Folded (`--group-fold`, docs/scale.md Session 29): a round by reduce-scatter completes on its
reducers' co-signatures (dht.grouping_shards), nobody holds its update whole, and each member
keeps the shards it holds (`keep_shards`) and takes the update as a candidate of its fetch
round with the round's other members (`_finish`): the round's sums carry it, one fetch round
later than a round applied at once; a fetch round that falls back assembles it whole from its
shards' holders and applies it in id order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from dht.budget import StreamLimits
from dht.group_exchange_done import DONE_LIMITS, DoneExchange, _round_id, push_targets
from dht.group_exchange_early import EarlyExchange
from dht.group_exchange_fetch import FetchExchange
from dht.group_exchange_shards import (
    PIECE_LIMITS,
    SHARD_LIMITS,
    ShardedExchange,
    until_due,
)
from dht.group_notice import SignedDone
from dht.grouping_census import SenderBook
from dht.grouping_done import Done
from dht.grouping_follow import Follower
from dht.grouping_patience import grace_s, joins_in_time
from dht.grouping_round import Cosign, GroupRound, cosign_max_bytes, decode_cosign
from dht.grouping_shards import Piece, ShardedRound
from dht.grouping_wire import (
    RoundId,
    decode_update,
    encode_part,
    update_max_bytes,
)
from merge.group_pipeline import GroupMerge
from merge.group_update import (
    Abandoned,
    ContributionHeader,
    GroupUpdate,
    Phase,
    ReductionConfig,
)
from merge.result import MergeResult
from merge.shard_holders import ShardHolding

if TYPE_CHECKING:
    from dht.network import SwarmNetwork

logger = logging.getLogger(__name__)

PART_LIMITS = StreamLimits(rate_per_s=2.0, burst=8.0, max_in_flight=2, deadline_s=120.0)
"""Contributions a peer may send: an honest member sends one per round (a few in a burst
when rounds are short), each a whole pseudo-gradient."""
COSIGN_LIMITS = StreamLimits(rate_per_s=10.0, burst=32.0, max_in_flight=4, deadline_s=10.0)
"""Co-signatures a peer may send: one per round and retry from an honest member."""
UPDATE_LIMITS = StreamLimits(rate_per_s=2.0, burst=8.0, max_in_flight=2, deadline_s=120.0)
"""Complete group updates a peer may push: one per round from each member that completed."""
MAX_SETTLED_ROUNDS = 64
"""Rounds this node ran whose ending (with the update or without) it remembers."""
SEND_TIMEOUT_S = 30.0

Reject = Callable[[str, str, str], None]
"""(reason, peer id, detail): a counted rejection of a peer's input."""


class GroupExchange(EarlyExchange, ShardedExchange, FetchExchange, DoneExchange):
    """This node's group rounds over the network; one round per (group, epoch, round)."""

    def __init__(
        self,
        network: SwarmNetwork,
        *,
        numel: int,
        reject: Reject,
        is_alive: Callable[[str], bool],
        live_peers: Callable[[], list[str]] = list,
        on_update: Callable[[GroupUpdate], bool] | None = None,
        retain: Callable[[GroupUpdate], Awaitable[None]] | None = None,
        on_received: Callable[[str, str, int], None] | None = None,
        offer: Callable[[str, int, str], object] | None = None,
        fetch: Callable[[str, str, int], Awaitable[bytes | None]] | None = None,
        applied_seq: Callable[[str], int] | None = None,
        shard_fetch: GroupMerge | None = None,
        on_event: Callable[..., None] | None = None,
        on_merged: Callable[[MergeResult], None] | None = None,
        fold: bool = False,
    ) -> None:
        """`live_peers`: the live peers' ids (a completed update's pushes go to them);
        `on_update`: takes a group update this node is not a member of the round of (run off
        the loop: it merges), True when it applied it; `retain`: keeps a group update this
        node holds to serve (the gossip's retained updates and holder record); `on_received`:
        (kind, sender, bytes) of each part and update that parsed (what bench.scale counts);
        `offer`: (group key, seq, holder) of a completed round's update this node should fetch
        as any replica (the gossip's catch-up); `fetch`: (peer, group key, seq) -> the update's
        wire bytes from that peer, or None (the gossip's `update` stream); `applied_seq`:
        group key -> the highest seq of its updates this replica applied (0: none), what a
        group-done notice of a group ahead of this node's is bounded by (dht.group_notice);
        `shard_fetch`: this node's group merge when other groups' updates are fetched by
        slices (--group-shard-fetch, dht.group_exchange_fetch), whose rounds `on_event` tells
        of (`shard_round`) and whose results `on_merged` is told; `fold`: a round by
        reduce-scatter is folded into its members' fetch round (--group-fold, in the run's
        fingerprint; only with `shard_fetch`)."""
        self.network = network
        self.identity = network.identity
        self.run_id = network.config.run_id
        self.numel = numel
        self._reject = reject
        self._is_alive = is_alive
        self._live_peers = live_peers
        self._on_update = on_update
        self._retain = retain
        self._on_received = on_received
        self._offer = offer
        self._fetch = fetch
        self._applied_seq = applied_seq
        self._init_fetch(shard_fetch, on_event, on_merged)
        if fold and shard_fetch is None:
            raise ValueError("the fold (--group-fold) needs the shard fetch (--group-shard-fetch)")
        self.fold = fold
        self._on_notice: set[RoundId] = set()
        """Rounds a group-done notice is being acted on for (one at a time per round)."""
        self._settled: OrderedDict[RoundId, bool] = OrderedDict()
        self._lists: OrderedDict[tuple[str, int], frozenset[str]] = OrderedDict()
        """(group key, epoch) -> the member list this node ran that group's rounds with."""
        """Rounds this node ran and ended: whether it ended holding the complete update."""
        self._rounds: dict[RoundId, GroupRound | ShardedRound] = {}
        self._held_pieces: OrderedDict[RoundId, dict[tuple[str, int], Piece]] = OrderedDict()
        self._wakes: dict[RoundId, asyncio.Event] = {}
        self._held: OrderedDict[RoundId, dict[str, tuple[ContributionHeader, torch.Tensor]]] = (
            OrderedDict()
        )
        self._held_since: dict[RoundId, float] = {}
        """When the first part of each held round arrived (the round's deadline runs from
        then: a member that finished training late does not wait a whole deadline of its own
        for a round its group has closed)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.highest_round: dict[str, int] = {}
        """Group key -> the highest round a member's verified part was seen for: a member
        that is behind (a newcomer, a restart) joins its group's round (node.group_publishing)."""
        self.follower = Follower(self.identity.peer_id)
        """Whether this member's last round ended alone, and where (dht.grouping_follow)."""
        self.senders = SenderBook()
        """The live peers inside a group's prefix that sent this node a verified part or piece,
        per (group key, epoch): what a member list that differs heals from
        (dht.grouping_census, node.group_publishing)."""

    async def register(self) -> None:
        await self.network.add_handler("group-part", self.rpc_part, PART_LIMITS)
        await self.network.add_handler("group-cosign", self.rpc_cosign, COSIGN_LIMITS)
        await self.network.add_handler("group-update", self.rpc_update, UPDATE_LIMITS)
        await self.network.add_handler("group-done", self.rpc_done, DONE_LIMITS)
        await self.network.add_handler("group-piece", self.rpc_piece, PIECE_LIMITS)
        await self.network.add_handler("group-shard", self.rpc_shard, SHARD_LIMITS)
        await self.network.add_handler("group-held", self.rpc_held, SHARD_LIMITS)
        await self.register_fetch()

    # ---- serving ----------------------------------------------------------------------------

    async def rpc_cosign(self, info: Any, reader: Any, writer: Any) -> None:
        sender = str(info.peer_id)
        cosign = await self._take(
            "group_cosign", sender, reader, cosign_max_bytes(), decode_cosign, counted=False
        )
        if cosign is None:
            return
        member = self._rounds.get(cosign.round_id)
        if not isinstance(member, GroupRound):
            return  # a round this node is not in (it left it out, or closed it): not a fault
        if not member.on_cosign(sender, cosign):
            self._reject("group_cosign_refused", sender, "a co-signature not for this round")
        self._wakes[cosign.round_id].set()

    async def rpc_update(self, info: Any, reader: Any, writer: Any) -> None:
        sender = str(info.peer_id)
        update = await self._take(
            "group_update",
            sender,
            reader,
            update_max_bytes(self.numel),
            lambda blob: decode_update(blob, self.numel),
        )
        if update is None:
            return
        rid = _round_id(update)
        member = self._rounds.get(rid)
        if member is not None and not member.done:
            if member.adopt(update):
                self._wakes[rid].set()
            else:
                self._reject("group_update_refused", sender, "an update this round cannot take")
        elif self._on_update is not None:  # another group's, or one this node was left out of
            loop = asyncio.get_running_loop()
            if await loop.run_in_executor(None, self._on_update, update):
                await self._hold(update)

    # ---- one round --------------------------------------------------------------------------

    async def run(
        self,
        header: ContributionHeader,
        tensor: torch.Tensor,
        members: Iterable[str],
        *,
        wait_s: float,
        cosign_s: float,
        config: ReductionConfig | None = None,
        codec: str = "fp32",
        payload: bytes | None = None,
    ) -> GroupUpdate | Abandoned:
        """This member's round: its part to every other member (`tensor` in `codec`, its
        encoding `payload` when at hand: the header signs `tensor` as decoded), theirs in until
        the deadline (`wait_s` from when the round's first part, this member's or another's,
        was here, and a grace for parts in flight: dht.grouping_patience.grace_s), then
        co-signatures until `cosign_s` past the join window; the outcome."""
        rid = (header.group_key, header.epoch, header.round)
        opened_at = await self._opened_at(rid, self._held, wait_s)
        if opened_at is None:
            return Abandoned("late")
        member = GroupRound(
            self.identity,
            header,
            tensor,
            members,
            opened_at=opened_at,
            wait_s=wait_s,
            cosign_s=cosign_s,
            config=config,
            grace_s=grace_s(wait_s),
        )
        with self._running(rid, member, header) as wake:
            for held_header, held_tensor in self._held.pop(rid, {}).values():
                if held_header.author != member.me:
                    member.on_part(held_header, held_tensor)
            part = encode_part(header, tensor, codec, payload)
            for peer in member.others():
                self._spawn(self._send_part(peer, part, wait_s))
            while not member.done:
                now = time.monotonic()
                await self._send_cosigns(member, member.tick(now))
                if member.phase is Phase.REDUCING:
                    for peer in member.missing_cosigners():
                        if peer != member.me and not self._is_alive(peer):
                            await self._send_cosigns(member, member.on_lost(peer))
                if not member.done:
                    await until_due(wake, member)
            return await self._finish(rid, member)

    async def _opened_at(
        self, rid: RoundId, held: OrderedDict[RoundId, dict[Any, Any]], wait_s: float
    ) -> float | None:
        """When this member's round opened, after following its group if its last round there
        ended alone (dht.grouping_follow, `_follow`): when its first part or piece was here, or
        now; None when that was `wait_s` or more ago (dht.grouping_patience.joins_in_time: the
        group's join window is over; late, its part kept for its next round, and what was held
        for it dropped). The round then collects for a grace past `wait_s`, so parts sent
        within the window reach every member before it closes (session 18)."""
        await self._follow(rid, wait_s)
        now = time.monotonic()
        if not joins_in_time(now, self._held_since.get(rid), wait_s):
            held.pop(rid, None)
            self._held_since.pop(rid, None)
            self._settle(rid, False)
            self.follower.ended(rid, "late", frozenset())
            return None
        return min(now, self._held_since.pop(rid, now))

    @contextlib.contextmanager
    def _running(
        self, rid: RoundId, member: GroupRound | ShardedRound, header: ContributionHeader
    ) -> Iterator[asyncio.Event]:
        """`member` runs round `rid` here (the rpcs hand it what arrives and set the event
        it waits on) until the block ends, however it ends."""
        if rid in self._rounds:
            raise ValueError(f"group round {rid} is already running")
        self._rounds[rid], wake = member, asyncio.Event()
        if not self.fold:  # folded, the own group's updates wait for a fetch round too
            self.own_key(rid[0])  # its updates never wait for a fetch round (--group-shard-fetch)
        self._remember_list(rid, member.members)
        self._wakes[rid] = wake
        self._note_round(header)
        try:
            yield wake
        finally:
            self._rounds.pop(rid, None)
            self._wakes.pop(rid, None)

    async def _finish(
        self, rid: RoundId, member: GroupRound | ShardedRound
    ) -> GroupUpdate | Abandoned:
        """The round's outcome: settled, and a complete update held and announced; folded,
        its shards held and the update a candidate of this member's fetch round (the node is
        given its fields, an empty aggregate: nothing to apply now)."""
        outcome = member.outcome
        assert outcome is not None
        self._settle(rid, not isinstance(outcome, Abandoned))  # applied here either way
        reason = outcome.reason if isinstance(outcome, Abandoned) else None
        self.follower.ended(rid, reason, member.reduction.contributors)
        if isinstance(outcome, Abandoned):
            return outcome
        if self.fold and isinstance(member, ShardedRound):
            holding = (
                outcome if isinstance(outcome, ShardHolding) else ShardHolding.of_whole(outcome)
            )
            update = holding.fields
            self.keep_shards((update.head.group_key, update.seq), holding)
            self.start_fetch_round(update, own=True)
        else:
            assert isinstance(outcome, GroupUpdate)
            update = outcome
            await self._hold(update)
            self.keep(update)  # --group-shard-fetch: its slices served, its fetch round run
            self.start_fetch_round(update)
        notice = SignedDone.of(Done.of(update), self.identity, self.run_id).to_bytes()
        for peer in push_targets(member, update, self._live_peers()):
            self._spawn(self._send(peer, "group-done", notice, SEND_TIMEOUT_S))
        return update

    def _remember_list(self, rid: RoundId, members: frozenset[str]) -> None:
        """The member list this node ran a round of (group key, epoch) with (joined by the
        lists of later rounds of that epoch): who may notify this node of that group's rounds."""
        key = rid[:2]
        self._lists[key] = self._lists.get(key, frozenset()) | members
        self._lists.move_to_end(key)
        if len(self._lists) > MAX_SETTLED_ROUNDS:
            self._lists.popitem(last=False)

    def _settle(self, rid: RoundId, holds: bool) -> None:
        self._settled[rid] = holds
        self._settled.move_to_end(rid)
        if len(self._settled) > MAX_SETTLED_ROUNDS:
            self._settled.popitem(last=False)

    async def _hold(self, update: GroupUpdate) -> None:
        """Retained to serve (a failure costs this copy, never the round)."""
        if self._retain is None:
            return
        try:
            await self._retain(update)
        except Exception as exc:
            logger.info("retaining group update %s failed: %r", update.update_id, exc)

    async def _send_part(self, peer: str, part: bytes, wait_s: float) -> None:
        await self._send(peer, "group-part", part, max(wait_s, 1.0))

    async def _send_cosigns(self, member: GroupRound, cosigns: list[Cosign]) -> None:
        """Each co-signature to the included members; one whose stream fails is lost (the
        reduction retries without it), which may yield another co-signature to send."""
        while cosigns:
            blob = cosigns.pop(0).to_bytes()
            peers = member.recipients()
            results = await asyncio.gather(
                *(self._send(p, "group-cosign", blob, SEND_TIMEOUT_S) for p in peers)
            )
            for peer, ok in zip(peers, results, strict=True):
                if not ok and not member.done:
                    cosigns += member.on_lost(peer)

    async def _send(self, peer: str, name: str, blob: bytes, timeout_s: float) -> bool:
        try:
            await self.network.send(peer, name, blob, timeout_s=timeout_s)
            return True
        except Exception as exc:  # any failure of the stream: the peer is not reached
            logger.info("%s to %s failed: %r", name, peer, exc)
            return False

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
