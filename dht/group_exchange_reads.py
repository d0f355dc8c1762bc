"""Reading one group message off a stream: what every part of dht.group_exchange.GroupExchange
shares. Its mixins (reduce-scatter, shard fetch, slices, notices, early parts) subclass
`ExchangeReads`, so one `_take` serves all of them instead of a declared copy in each."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from dht.grouping_wire import GroupMessageError
from dht.swarm_config import REQUEST_READ_TIMEOUT_S
from dht.transport import TooLargeError, TransportError, receive_blob

logger = logging.getLogger("dht.group_exchange")

M = TypeVar("M")
"""A decoded group message."""


class ExchangeReads:
    """A group message read, bounded, decoded, and counted (received bytes or a rejection)."""

    if TYPE_CHECKING:  # what GroupExchange provides
        _reject: Callable[[str, str, str], None]
        _on_received: Callable[[str, str, int], None] | None

    def _received(self, kind: str, sender: str, num_bytes: int) -> None:
        if self._on_received is not None:
            self._on_received(kind, sender, num_bytes)

    async def _receive(self, name: str, sender: str, reader: Any, max_bytes: int) -> bytes | None:
        try:
            return await receive_blob(
                reader, max_bytes=max_bytes, stall_timeout_s=REQUEST_READ_TIMEOUT_S
            )
        except TooLargeError as exc:
            self._reject(f"{name}_too_large", sender, str(exc))
        except TimeoutError:
            self._reject(f"{name}_timeout", sender, "stalled")
        except (TransportError, OSError) as exc:
            logger.debug("%s from %s dropped: %s", name, sender, exc)
        return None

    async def _take(
        self,
        name: str,
        sender: str,
        reader: Any,
        max_bytes: int,
        decode: Callable[[bytes], M],
        counted: bool = True,
    ) -> M | None:
        """A `name` message read and decoded; None when it was too large, stalled, dropped
        or refused by `decode` (a GroupMessageError, counted as `{name}_{reason}`). Its
        bytes count as received (`name` without "group_") when `counted`."""
        blob = await self._receive(name, sender, reader, max_bytes)
        if blob is None:
            return None
        try:
            message = decode(blob)
        except GroupMessageError as exc:
            self._reject(f"{name}_{exc.reason}", sender, str(exc))
            return None
        if counted:
            self._received(name.removeprefix("group_"), sender, len(blob))
        return message
