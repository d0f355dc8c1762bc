"""The reduce-scatter side of a learner group's round over the network (`--group-scatter`):
the `group-piece` and `group-shard` streams and the coroutine that drives one member's
`ShardedRound` (dht.grouping_shards, pure). A mixin of dht.group_exchange.GroupExchange, which
holds the state it uses (the rounds running here, the pieces held for rounds not opened yet)
and the streams' plumbing; split out of it in session 14.

Session 14 (dht.grouping_patience): a piece or reduced shard whose send failed is sent again
(`SendRetry`), and a shard's recipient is declared lost only when every try failed; the
round's co-sign deadline moves once for one live reducer late with its shard.

Session 18: a reducer the live view says is gone is lost only past the first co-sign deadline
(`ShardedRound.tick` decides it, dht.grouping_patience.CosignClock.losses), not the moment a
flapping view says so, and failed sends no longer make a peer lost; and a round keeps
collecting pieces a grace past its join window (dht.grouping_patience.grace_s), so a
member's pieces sent in time reach every member.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from dht.budget import StreamLimits
from dht.group_exchange_reads import ExchangeReads
from dht.grouping import member_check
from dht.grouping_patience import RESEND_AFTER_S, SendRetry, grace_s, send_timeout_s
from dht.grouping_round import GroupRound
from dht.grouping_shards import (
    Piece,
    ReducedShard,
    ShardedRound,
    WireShard,
    decode_piece,
    decode_shard,
    encode_piece,
    piece_max_bytes,
    shard_codec,
    shard_max_bytes,
)
from dht.grouping_wire import GroupMessageError, RoundId
from dht.transport import TransportError, send_blob
from merge.group_update import Abandoned, ContributionHeader, GroupUpdate, Phase, ReductionConfig

if TYPE_CHECKING:
    from dht.network import SwarmNetwork
    from merge.identity import Identity

logger = logging.getLogger(__name__)

PIECE_LIMITS = StreamLimits(rate_per_s=8.0, burst=32.0, max_in_flight=4, deadline_s=120.0)
"""Pieces a peer may send (--group-scatter): one per round before the deadline, a few more
re-sent after it (shards of members left out or lost), each a shard of a part."""
SHARD_LIMITS = StreamLimits(rate_per_s=8.0, burst=32.0, max_in_flight=4, deadline_s=120.0)
"""Reduced shards a peer may send: its shards of each round, once per attempt (on
`group-shard`, or folded on `group-held` to the shard's replica holder)."""
HELD, NOT_HELD = b"held", b"none"
"""A replica holder's answer on `group-held`: it holds the shard's values for that attempt,
or not (yet)."""
HELD_WAIT_S = 1.5
"""How long a replica holder waits, before it answers NOT_HELD, for its round to reach the
attempt the values were reduced over (a holder still collecting keeps them aside until it
closes: answering at once cost the reducer a resend a second later, and the group's members
completed seconds apart). Under the reducer's shortest try (send_timeout_s: 2 s)."""
HELD_POLL_S = 0.05
MAX_HELD_PIECES = 64
"""Pieces held per round before this node opens it (one per member, and a few re-sent)."""
TICK_S = 0.25
"""The longest a round waits between looks at its deadlines and its members' liveness."""


def own_message(header: ContributionHeader, sender: str, run_id: str, what: str) -> None:
    """Refuses (GroupMessageError) a part or piece its sender did not author, or of another
    run: each member sends its own, never one relayed for another."""
    if header.author != sender:
        raise GroupMessageError("wrong_sender", f"{what} relayed for another member")
    if header.run_id != run_id:
        raise GroupMessageError("wrong_run", f"{what} of run {header.run_id!r}")


def new_refusal(before: Mapping[str, int], after: Mapping[str, int]) -> str:
    """The refusal a reduction just counted (its `rejected` before and after one message)."""
    return next((r for r in after if after[r] != before.get(r)), "refused")


class ShardedExchange(ExchangeReads):
    """GroupExchange's reduce-scatter streams and rounds (see the module's docstring)."""

    if TYPE_CHECKING:  # what GroupExchange provides
        identity: Identity
        network: SwarmNetwork
        run_id: str
        numel: int
        fetch_wait_s: float
        fold: bool
        _rounds: dict[RoundId, GroupRound | ShardedRound]
        _wakes: dict[RoundId, asyncio.Event]
        _settled: OrderedDict[RoundId, bool]
        _held_pieces: OrderedDict[RoundId, dict[tuple[str, int], Piece]]
        _is_alive: Callable[[str], bool]
        _reject: Callable[[str, str, str], None]

        def _book(self, header: ContributionHeader) -> None: ...
        def _note_round(self, header: ContributionHeader) -> None: ...
        def _holding(
            self, store: OrderedDict[RoundId, dict[Any, Any]], rid: RoundId
        ) -> dict[Any, Any]: ...
        async def _opened_at(
            self, rid: RoundId, held: OrderedDict[RoundId, dict[Any, Any]], wait_s: float
        ) -> float | None: ...
        def _running(
            self, rid: RoundId, member: GroupRound | ShardedRound, header: ContributionHeader
        ) -> contextlib.AbstractContextManager[asyncio.Event]: ...
        async def _finish(
            self, rid: RoundId, member: GroupRound | ShardedRound
        ) -> GroupUpdate | Abandoned: ...
        async def _send(self, peer: str, name: str, blob: bytes, timeout_s: float) -> bool: ...
        def _spawn(self, coro: Any) -> None: ...

    async def rpc_piece(self, info: Any, reader: Any, writer: Any) -> None:
        """A shard of a member's part (--group-scatter): checked against its author's
        signature, taken by the round if it runs, else held (bounded) until it opens."""
        sender = str(info.peer_id)

        def decode(blob: bytes) -> Piece:
            piece = decode_piece(blob, self.numel)
            own_message(piece.header, sender, self.run_id, "a piece")
            return piece

        piece = await self._take("group_piece", sender, reader, piece_max_bytes(self.numel), decode)
        if piece is None:
            return
        header = piece.header
        self._book(header)
        rid = (header.group_key, header.epoch, header.round)
        member = self._rounds.get(rid)
        if isinstance(member, ShardedRound):
            before = dict(member.reduction.rejected)
            if member.on_piece(piece):
                self._note_round(header)
            else:
                reason = new_refusal(before, member.reduction.rejected)
                self._reject(f"group_piece_{reason}", sender, "a piece this round refused")
            self._wakes[rid].set()
            return
        if member is not None or not member_check(self.run_id, header.group_key)(sender):
            self._reject("group_piece_not_a_member", sender, "a piece for another round")
            return
        if rid in self._settled or not self._is_alive(sender):
            return  # a round ended here (a late re-send), or a fresh key: nothing held
        held = self._holding(self._held_pieces, rid)
        if len(held) < MAX_HELD_PIECES:
            held.setdefault((sender, piece.shard), piece)
            self._note_round(header)

    async def rpc_shard(self, info: Any, reader: Any, writer: Any) -> None:
        """A reduced shard and its reducer's co-signature, for a round this node runs."""
        await self._on_shard(str(info.peer_id), reader)

    async def rpc_held(self, info: Any, reader: Any, writer: Any) -> None:
        """A folded round's reduced shard sent to its replica holder (this node), taken as
        `group-shard`'s and answered HELD once this node's round holds its values for the
        attempt it names, NOT_HELD otherwise: the reducer counts its shard, and sends its
        seal to the others, only after HELD (dht.grouping_shards, session 30)."""
        got = await self._on_shard(str(info.peer_id), reader)
        held = got is not None and await _held_soon(*got)
        with contextlib.suppress(TransportError, OSError, TimeoutError):
            await send_blob(writer, HELD if held else NOT_HELD)

    async def _on_shard(
        self, sender: str, reader: Any
    ) -> tuple[ShardedRound, ReducedShard | WireShard] | None:
        """A reduced shard read and handed to its round (a counted refusal when the round
        refuses it); the round and the shard, None when no round of it runs here."""
        shard = await self._take(
            "group_shard",
            sender,
            reader,
            shard_max_bytes(self.numel),
            lambda blob: decode_shard(blob, self.numel),
        )
        if shard is None:
            return None
        member = self._rounds.get(shard.round_id)
        if not isinstance(member, ShardedRound):
            return None  # a round this node is not in (left out, or closed): not a fault
        if not member.on_shard(sender, shard):
            self._reject("group_shard_refused", sender, "a reduced shard this round refused")
        self._wakes[shard.round_id].set()
        return member, shard

    async def run_sharded(
        self,
        header: ContributionHeader,
        digests: tuple[str, ...],
        tensor: torch.Tensor,
        members: Iterable[str],
        *,
        wait_s: float,
        cosign_s: float,
        config: ReductionConfig | None = None,
        codec: str = "fp32",
    ) -> GroupUpdate | Abandoned:
        """This member's round by reduce-scatter (--group-scatter): shard j of its part to
        member j, the pieces of its own shards in until the deadline (from when the round's
        first piece was here), its shards reduced and sent to the included members (folded:
        the values to each shard's replica holder, a seal to the others: dht.grouping_shards),
        theirs in until `cosign_s` later; a reducer with a shard missing that the live view says is
        gone past the co-sign deadline: retry once without it (pieces re-sent to the shards'
        new reducers) or abandon. `tensor` is what `codec`
        decodes (bf16 and fp32 slices re-encode exactly; any other codec's pieces go fp32)."""
        rid = (header.group_key, header.epoch, header.round)
        self.fetch_wait_s = wait_s  # the fetch round's deadlines (dht.group_exchange_fetch)
        opened_at = await self._opened_at(rid, self._held_pieces, wait_s)
        if opened_at is None:
            return Abandoned("late")
        member = ShardedRound(
            self.identity,
            header,
            digests,
            tensor,
            members,
            opened_at=opened_at,
            wait_s=wait_s,
            cosign_s=cosign_s,
            config=config,
            grace_s=grace_s(wait_s),
            fold=self.fold,
        )
        piece_codec = codec if codec in ("bf16", "fp32") else "fp32"
        with self._running(rid, member, header) as wake:
            for piece in self._held_pieces.pop(rid, {}).values():
                member.on_piece(piece)
            while not member.done:
                for shard, peer in member.piece_sends():
                    blob = encode_piece(header, digests, shard, member.pieces[shard], piece_codec)
                    self._spawn(self._send_piece(member, peer, blob, max(wait_s, 1.0)))
                for out in member.tick(time.monotonic(), self._is_alive):
                    assert out.tensor is not None and out.digest is not None
                    blob = out.to_bytes(shard_codec(out.tensor))
                    # folded: the values to the shard's replica holder, then a seal to the others
                    holder = member.replica_holder(out.shard) if self.fold else None
                    if holder is not None:
                        self._spawn(self._send_folded(member, out, holder, blob, cosign_s))
                        continue
                    for peer in member.recipients():
                        self._spawn(self._send_shard(member, peer, blob, cosign_s))
                if not member.done:
                    await until_due(wake, member)
            return await self._finish(rid, member)

    async def _send_piece(
        self, member: ShardedRound, peer: str, blob: bytes, timeout_s: float
    ) -> None:
        """A piece to its shard's member or reducer, tried again after a failure while the
        round lasts (dht.grouping_patience.SendRetry): a reducer missing one piece holds up
        the round."""
        retry = SendRetry()
        while not member.done and not await self._send(peer, "group-piece", blob, timeout_s):
            if not retry.failed(time.monotonic(), until=member.cosign_deadline):
                return
            await asyncio.sleep(RESEND_AFTER_S)

    async def _send_folded(
        self, member: ShardedRound, out: ReducedShard, holder: str, blob: bytes, cosign_s: float
    ) -> None:
        """A folded round's reduced shard: its values to `holder` (`group-held`) until it
        answers HELD, tried again while the attempt lasts (SendRetry); then the shard counts
        here and its seal goes to the other included members. No holder, no seal: a member
        that completes on seals knows each shard is at its reducer and its replica holder
        (stop 47's CI run: a reducer killed with its values in flight, a member completed on
        its seal, and no live node held that shard). A holder that never answers HELD leaves
        the shard missing here and at the others: the round retries without the lost or
        abandons, as for any reducer late with its shard."""
        retry, timeout_s = SendRetry(), send_timeout_s(cosign_s)
        while not await self._held_by(holder, blob, timeout_s):
            if member.done or member.reduction.included != out.included:
                return
            if not retry.failed(time.monotonic(), until=member.cosign_deadline):
                return
            await asyncio.sleep(RESEND_AFTER_S)
        if not member.replica_took(out):
            return  # the round moved on to another attempt meanwhile
        wake = self._wakes.get(member.round_id)
        if wake is not None:
            wake.set()
        assert out.digest is not None
        seal = out.seal_bytes(out.digest)
        for peer in member.recipients():
            if peer != holder:
                self._spawn(self._send_shard(member, peer, seal, cosign_s))

    async def _held_by(self, holder: str, blob: bytes, timeout_s: float) -> bool:
        """`blob` (a reduced shard's values) to `holder`'s `group-held`: whether it answered
        HELD."""
        try:
            answer = await self.network.exchange(
                holder, "group-held", blob, max_bytes=len(HELD), timeout_s=timeout_s
            )
        except Exception as exc:  # any failure of the stream: not held (yet)
            logger.info("group-held to %s failed: %r", holder, exc)
            return False
        return answer == HELD

    async def _send_shard(
        self, member: ShardedRound, peer: str, blob: bytes, cosign_s: float
    ) -> None:
        """A reduced shard to an included member, tried again after a failure while the round
        lasts (dht.grouping_patience.SendRetry). Failed sends never make the peer lost
        (session 18: under load a member's streams fail for seconds, and a sender that
        retried without it alone split the round); a dead member is lost by the live view
        past the co-sign deadline (ShardedRound.tick), and a live one that never got this
        shard adopts the update it is told of (group-done)."""
        retry, timeout_s = SendRetry(), send_timeout_s(cosign_s)
        while not await self._send(peer, "group-shard", blob, timeout_s):
            if member.done or peer not in member.recipients():
                return
            if not retry.failed(time.monotonic(), until=member.cosign_deadline):
                return
            await asyncio.sleep(RESEND_AFTER_S)


async def _held_soon(member: ShardedRound, shard: ReducedShard | WireShard) -> bool:
    """Whether `member` holds `shard`'s values for the attempt it names, waiting up to
    HELD_WAIT_S while its round runs for it to get there."""
    deadline = time.monotonic() + HELD_WAIT_S
    while not member.holds(shard):
        if member.done or time.monotonic() >= deadline:
            return False
        await asyncio.sleep(HELD_POLL_S)
    return True


async def until_due(wake: asyncio.Event, member: GroupRound | ShardedRound) -> None:
    """Until a message for the round came in, its next deadline, or TICK_S (liveness)."""
    collecting = member.phase is Phase.COLLECTING
    due = member.deadline if collecting else member.cosign_deadline
    wake.clear()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(wake.wait(), min(TICK_S, max(due - time.monotonic(), 0.0)))
