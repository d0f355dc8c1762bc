"""Headers: what this node hears of peers' updates before fetching them, pushed (rpc_notify)
or read from the DHT's announcements; each is checked by the merge, then handed to CatchUp."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from dht.budget import StreamLimits
from dht.deferred import DeferredNotifies
from dht.gossip_context import GossipContext
from dht.messages import MAX_SIGNED_HEADER_BYTES, MessageError, parse_signed_header
from dht.swarm_config import REQUEST_READ_TIMEOUT_S
from dht.transport import TooLargeError, TransportError, receive_blob
from merge.envelope import SignedHeader
from merge.equivocation import Proof
from merge.group_equivocation import GroupProof

logger = logging.getLogger(__name__)
NOTIFY_LIMITS = StreamLimits(rate_per_s=20.0, burst=64.0, max_in_flight=4, deadline_s=10.0)
"""Pushed headers a peer may send (an honest one sends one a round)."""


class Headers:
    """Checks each header heard (the merge's check_header) and tells CatchUp of the good ones;
    a conflicting one becomes evidence (`on_evidence`)."""

    def __init__(
        self, context: GossipContext, on_evidence: Callable[[Proof | GroupProof | None], None]
    ) -> None:
        self._ctx = context
        self._on_evidence = on_evidence
        self._deferred = DeferredNotifies()
        """Pushed headers of peers whose heartbeat is not read yet (dht.deferred)."""

    def on_header(self, signed: SignedHeader) -> None:
        ctx, header = self._ctx, signed.header
        reason = ctx.merge.check_header(signed)
        if reason == "duplicate":
            return
        if reason is not None:
            ctx.reject(reason, header.author, "header check failed", seq=header.seq)
            if reason == "equivocation":
                self._on_evidence(ctx.merge.evidence(signed))
            if reason != "bad_signature":  # a forged header says nothing of the real update
                ctx.catchup.fetched(header.update_id)  # settled: not worth fetching
            return
        if ctx.catchup.announced(header.author, header.seq, signed, time.monotonic()):
            ctx.kick()

    def settle_deferred(self) -> None:
        """The pushes held for peers unknown then: heard now if both peers' heartbeats were
        read since, refused if a read or two later they are still unknown (dht.deferred)."""
        membership = self._ctx.membership
        read_started = membership.last_read_started
        if read_started is not None and len(self._deferred):
            settled = self._deferred.after_read(read_started, membership.is_alive)
            for sender in settled.refused:
                self._reject_unknown(sender)
            for signed in settled.accepted:
                self.on_header(signed)

    def _reject_unknown(self, sender: str) -> None:
        self._ctx.reject("notify_unknown_peer", sender, "no live heartbeat", update=False)

    async def rpc_notify(self, info: Any, reader: Any, writer: Any) -> None:
        """A pushed header: verified before anything about its author is stored or marked.

        Only peers with a live signed heartbeat may push, within a per-peer budget
        (NOTIFY_LIMITS, enforced by SwarmNetwork), and only headers of authors with a live
        heartbeat are kept: fresh keys get no state here.
        """
        ctx, sender = self._ctx, str(info.peer_id)
        try:
            blob = await asyncio.wait_for(
                receive_blob(reader, max_bytes=MAX_SIGNED_HEADER_BYTES), REQUEST_READ_TIMEOUT_S
            )
            signed = parse_signed_header(blob)
            author = signed.header.author
            if author == ctx.peer_id or not ctx.active:
                return
            if not (ctx.membership.is_alive(sender) and ctx.membership.is_alive(author)):
                # Held until the next reads (dht.deferred): a peer that just joined pushes
                # before this node has read its heartbeat.
                known = ctx.replica.last_seq(sender) >= 1  # a track record: held first
                for evicted in self._deferred.hold(sender, signed, time.time(), known=known):
                    self._reject_unknown(evicted)
                return
            self.on_header(signed)
        except MessageError as exc:  # counted against who sent it, not whom it names
            ctx.reject(f"notify_{exc.reason}", sender, str(exc), update=False)
        except TooLargeError as exc:
            ctx.reject("notify_too_large", sender, str(exc), update=False)
        except TimeoutError:
            ctx.reject("notify_timeout", sender, "no header within the timeout", update=False)
        except (TransportError, OSError) as exc:
            logger.debug("notification from %s dropped: %s", sender, exc)
