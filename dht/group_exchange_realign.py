"""The shard fetch's realignment from a group's class (`--group-shard-fetch`; docs/scale.md,
Session 22): a member left out of a fetch round's class takes a class member's state at its
next round (the decision: dht.realign_class), and meanwhile fetches nothing whole that the
state will bring. A mixin of dht.group_exchange_fetch.FetchExchange.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from dht.realign_class import REASONS, ClassRealign
from dht.shard_fetch_inbox import Inbox

if TYPE_CHECKING:
    from merge.identity import Identity

logger = logging.getLogger(__name__)


class ClassRealignment:
    """FetchExchange's realignment from its group's class (see the module's docstring)."""

    if TYPE_CHECKING:  # what GroupExchange provides
        identity: Identity

        def _spawn(self, coro: Any) -> None: ...

    def _init_realign(self) -> None:
        self.class_realign = ClassRealign(self.identity.peer_id)
        """When this member, left out of its group's class, takes a class member's state."""
        self.realign: Callable[[str], Awaitable[bool]] | None = None
        """Loads a peer's state as a realignment does (dht.swarm `realign_from_class`):
        whether it loaded. None: this member never realigns from its class."""

    def _waits_for_class(self, outcome: str) -> bool:
        """Left out of a class it will take the state of at its next round (dht.realign_class
        `due`): this member fetches nothing whole now, since the donor's state will hold the
        round's updates (fetched whole and applied, they would be bytes spent for a state
        then replaced). What the realignment does not bring is handed to the gossip by the
        candidates' own timer (`FALLBACK_ROUNDS` group waits after the notice)."""
        return (
            self.realign is not None
            and outcome in REASONS
            and self.class_realign.due(time.monotonic())
        )

    def _realign_from_class(self, members: list[str], inbox: Inbox) -> asyncio.Task[bool] | None:
        """Left out of the last round's class (dht.realign_class): a class member's state,
        downloaded while the round collects (the task), so this round has this member back."""
        if self.realign is None:
            return None
        decision = self.class_realign.decide(members, time.monotonic())
        if decision is None:
            return None
        inbox.realigned_from = decision[0]
        logger.info("left out of the last fetch round's class (%s): taking %s's state",
                    decision[1].reason, decision[0])  # fmt: skip
        return asyncio.ensure_future(self.realign(decision[0]))

    async def _realigned(self, task: asyncio.Task[bool], inbox: Inbox, bound_s: float) -> None:
        """The realignment done, waited for at most `bound_s`: past it this member proposes
        from the state it holds (the others run without it, as before; falling back here
        would abort their round) and the download lands when it does (the transfer's
        deadline bounds it), the retained updates offered again as after any realignment."""
        done, _ = await asyncio.wait({task}, timeout=bound_s)
        if not done:
            self._spawn(task)  # kept referenced until it ends
            return
        loaded = not task.cancelled() and task.exception() is None and task.result()
        inbox.realign_loaded = loaded
        self.class_realign.finished(loaded=loaded)
