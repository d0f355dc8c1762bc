"""One fetch round's inbox and how a round ends with nothing applied (dht.group_exchange_fetch,
the shard fetch's coroutine, waits on it): a fetch round's messages by kind and sender, and
`Fallback`, the exception a round that falls back raises with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from dht.shard_fetch_wire import FetchMessage
from merge.shard_fetch import UpdateId


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
        self.realigned_from: str | None = None
        """The class member whose state this member took before proposing (left out of the
        last round's class: dht.realign_class), for the `shard_round` event."""
        self.realign_loaded: bool | None = None
        """Whether that download loaded (None: none, or not done before the proposal)."""
        self.num_bases = 0
        self.class_size = 0
        """Distinct bases among the members' proposals, and the members of the class the
        round ran among (0: none), for the `shard_round` event: why a round had no class."""
        self.waits_for_class = False
        """Left out of this round's class, this member fetched nothing whole: the class
        member's state it takes at its next round holds the round's updates."""

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
