"""Serving: the updates this node retains, to the peers that ask for one by (author, seq)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from dht.budget import StreamLimits
from dht.messages import MAX_SEQ
from dht.resumable import parse_part_request, part_answer
from dht.retention import RetainedUpdates
from dht.swarm_config import REQUEST_READ_TIMEOUT_S
from dht.transport import TransportError, decode_request, receive_blob, send_blob, send_refusal

logger = logging.getLogger(__name__)
UPDATE_RATE_PER_S = 20.0
"""Update fetches a peer may start per second (an honest one fetches each update once)."""
UPDATE_BURST = 128.0
UPDATE_IN_FLIGHT = 4


def update_limits(transfer_timeout_s: float) -> StreamLimits:
    """What one peer's update fetches may cost this node; each ends by `transfer_timeout_s`."""
    return StreamLimits(
        rate_per_s=UPDATE_RATE_PER_S,
        burst=UPDATE_BURST,
        max_in_flight=UPDATE_IN_FLIGHT,
        deadline_s=transfer_timeout_s,
    )


class UpdateServer:
    """Answers `update` streams from the retained copies: the update's wire bytes, or a
    refusal when it is not held (the stream's budget, deadline and closing: SwarmNetwork)."""

    def __init__(self, retained: RetainedUpdates) -> None:
        self._retained = retained

    async def rpc_update(self, _info: Any, reader: Any, writer: Any) -> None:
        """Serve a retained update from the offset asked (dht.resumable; the stream's deadline
        and closing: SwarmNetwork)."""
        try:
            request = await asyncio.wait_for(
                receive_blob(reader, max_bytes=4096), REQUEST_READ_TIMEOUT_S
            )
            args = decode_request(request).get("args")
            whole = isinstance(args, list) and len(args) == 2  # a node of an earlier version
            uid, offset = (parse_update_request(args), 0) if whole else parse_part_request(args)
            data = await asyncio.to_thread(self._retained.get, uid)
            if data is None:
                await send_refusal(writer, "not held")
            else:
                await send_blob(writer, data if whole else part_answer(data, offset))
        except (TransportError, ValueError, TypeError, OSError, TimeoutError) as exc:
            logger.debug("update request failed: %s", exc)


def parse_update_request(args: object) -> tuple[str, int]:
    """The (author, seq) a peer asks for: a short author string and a seq in [1, MAX_SEQ]."""
    if not isinstance(args, list) or len(args) != 2:
        raise TransportError("malformed request")
    author, seq = args
    if not isinstance(author, str) or not 0 < len(author) <= 128:
        raise TransportError("malformed request: the author is not a short string")
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        raise TransportError("malformed request: the seq is not an integer in range")
    return author, seq
