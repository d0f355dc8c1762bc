"""Evidence: proofs of equivocation (two signed payloads under one update id: an author's,
merge.equivocation; or two co-signed variants of one learner group's round,
merge.group_equivocation), settled here by the merge and passed on to the peers gossip pushes
to. Both kinds travel on the one `evidence` stream; their magic tells them apart."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

from dht.budget import StreamLimits
from dht.gossip_context import GossipContext
from dht.gossip_groups import parse_fetched
from dht.grouping import member_check
from dht.swarm_config import REQUEST_READ_TIMEOUT_S
from dht.transport import TooLargeError, TransportError, receive_blob
from merge.envelope import EnvelopeError, SignedUpdate, UpdateHeader
from merge.equivocation import Action, Proof, ProofError, UpdateId
from merge.group_equivocation import MAX_EVIDENCE_BYTES, GroupProof, GroupRun, decode_proof
from merge.group_update import GroupUpdate

logger = logging.getLogger(__name__)
EVIDENCE_LIMITS = StreamLimits(rate_per_s=2.0, burst=16.0, max_in_flight=2, deadline_s=10.0)
"""Proofs of equivocation a peer may push (an honest one passes on each proof once)."""


class Evidence:
    """Settles proofs of equivocation (off the loop: one may withdraw an applied update) and
    passes each on once; a bad pushed proof is counted against its sender."""

    def __init__(self, context: GossipContext) -> None:
        self._ctx = context
        run_id = context.config.run_id
        self._run = GroupRun(run_id, functools.partial(member_check, run_id))
        """What a group's proof is checked against (the merge checks it again, by its own)."""
        self.on_superseded: Callable[[UpdateId, str | None], None] = lambda uid, sender: None
        """Told of a group round whose lesser variant a proof withdrew here, and the proof's
        sender: the prevailing variant is fetched (dht.gossip_fetch `fetch_awaited_later`)."""

    def on_evidence(self, proof: Proof | GroupProof | None, sender: str | None = None) -> None:
        """Settle a proof off the loop (it may withdraw an applied update), then pass it on."""
        if proof is not None and self._ctx.active:
            self._ctx.network.spawn(self._settle(proof, sender))

    def from_thread(self, proof: Proof | GroupProof | None) -> None:
        """`on_evidence` from a thread off the loop (a merge there made the proof)."""
        if proof is not None:
            self._ctx.network.loop.call_soon_threadsafe(self.on_evidence, proof)

    async def _settle(self, proof: Proof | GroupProof, sender: str | None) -> None:
        ctx = self._ctx
        action: Action
        if isinstance(proof, GroupProof):
            action = await ctx.off_loop(ctx.merge.learn_group_proof, proof, self._retained_group)
        else:
            action = await ctx.off_loop(ctx.merge.learn_proof, proof, self._retained_update)
        ctx.catchup.fetched(proof.update_id)
        if action == "withdraw" and isinstance(proof, GroupProof) and proof.superseded_key:
            self.on_superseded(proof.update_id, sender)
        if action == "none":
            return
        author, seq = proof.update_id
        ctx.on_event("equivocation_proven", author=author, seq=seq, action=action)
        blob = proof.to_bytes()
        peers = ctx.push_targets(exclude=sender)
        await asyncio.gather(
            *(ctx.network.send(p, "evidence", blob, timeout_s=5.0) for p in peers),
            return_exceptions=True,
        )

    def _retained_update(self, header: UpdateHeader) -> SignedUpdate | None:
        """The update applied here under `header`'s id, from the retained copies (off the loop)."""
        data = self._ctx.retained.get(header.update_id)
        if data is None:
            return None
        try:
            return SignedUpdate.from_bytes(data)
        except EnvelopeError:
            return None

    def _retained_group(self, uid: UpdateId) -> GroupUpdate | None:
        """The group update applied here under `uid`, from the retained copies (off the loop)."""
        data = self._ctx.retained.get(uid)
        parsed = None if data is None else parse_fetched(data, uid, self._ctx.replica.numel)
        return None if parsed is None or isinstance(parsed, str) else parsed

    async def rpc_evidence(self, info: Any, reader: Any, writer: Any) -> None:
        """A pushed proof of equivocation: checked (every signature, this run, a group's by
        its members) off the loop before anything is done with it; a bad one is counted
        against its sender."""
        ctx, sender = self._ctx, str(info.peer_id)
        try:
            blob = await asyncio.wait_for(
                receive_blob(reader, max_bytes=MAX_EVIDENCE_BYTES), REQUEST_READ_TIMEOUT_S
            )
            if not ctx.membership.is_alive(sender):
                ctx.reject("evidence_unknown_peer", sender, "no live heartbeat", update=False)
                return
            proof = await ctx.off_loop(decode_proof, blob, ctx.config.fingerprint, self._run)
            self.on_evidence(proof, sender)
        except ProofError as exc:
            ctx.reject(f"evidence_{exc.reason}", sender, str(exc), update=False)
        except TooLargeError as exc:
            ctx.reject("evidence_too_large", sender, str(exc), update=False)
        except (TransportError, OSError, TimeoutError) as exc:
            logger.debug("evidence from %s dropped: %s", sender, exc)
