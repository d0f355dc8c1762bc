"""What the parts of gossip share (dht.gossip builds it): the network, membership, the merge
behind its port, the catch-up decisions, the retained updates, and how to report.

Each part (announce, headers, fetch, repair, evidence, serve) holds this context and the
one or two calls into a sibling it needs; none holds another part.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

from dht.catchup import CatchUp
from dht.membership import Membership
from dht.merge_port import MergePort
from dht.network import SwarmNetwork
from dht.rejections import Rejections
from dht.retention import RetainedUpdates
from dht.swarm_config import MIN_LINK_BYTES_PER_S, SwarmConfig
from merge.replica import Replica
from merge.result import MergeResult

T = TypeVar("T")
MAX_PUSH_NEWCOMERS = 8
"""Live peers without a contribution yet that each published header is pushed to."""


@dataclass(kw_only=True, eq=False)
class GossipContext:
    """The state and collaborators every part of gossip works with (all on the loop)."""

    network: SwarmNetwork
    membership: Membership
    merge: MergePort
    catchup: CatchUp
    """What to fetch, from whom, and what is lost (pure: dht.catchup)."""
    retained: RetainedUpdates
    """Updates this node keeps to serve (its own and those it merged)."""
    merge_pool: Executor
    """The one thread the merge runs on, off the loop."""
    reject: Rejections
    on_merge: Callable[[MergeResult], None]
    on_event: Callable[..., None]
    active: bool = False
    """Set when gossip starts (after an optional state download): until then nothing heard
    is acted on."""
    wake: asyncio.Event | None = None
    """Wakes the pump (dht.gossip) when there is something to fetch or to decide."""

    @property
    def config(self) -> SwarmConfig:
        return self.network.config

    @property
    def peer_id(self) -> str:
        return self.network.peer_id

    @property
    def replica(self) -> Replica:
        return self.merge.replica

    def kick(self) -> None:
        """Let the pump act on CatchUp's decisions now rather than at its next period."""
        if self.wake is not None:
            self.wake.set()

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the merge's thread (the merge is never called on the loop)."""
        return await asyncio.get_running_loop().run_in_executor(self.merge_pool, fn, *args)

    def push_targets(self, exclude: str | None = None) -> list[str]:
        """The live peers (but `exclude`) a header or proof is pushed to (push_targets)."""
        alive = [h.peer_id for h in self.membership.alive_peers() if h.peer_id != exclude]
        return push_targets(alive, lambda p: self.replica.last_seq(p) >= 1)

    @property
    def transfer_timeout_s(self) -> float:
        """Enough for the largest payload over the slowest link, plus connection set-up; a
        stalled transfer is cut much sooner (no byte for REQUEST_READ_TIMEOUT_S)."""
        return 10.0 + self.config.max_update_bytes / MIN_LINK_BYTES_PER_S


def push_targets(
    alive: list[str], contributed: Callable[[str], bool], newcomers: int = MAX_PUSH_NEWCOMERS
) -> list[str]:
    """The live peers a header or proof is pushed to, in `alive`'s order: every peer that has
    contributed, and at most `newcomers` that have not (a newcomer finds the rest through
    announcements). ~1,000 Sybil heartbeats cost a few streams a publish, not a thousand
    (open files rose to ~900 of 1,024 in bench.attack's Sybil class)."""
    contributors = [p for p in alive if contributed(p)]
    others = [p for p in alive if not contributed(p)]
    return contributors + others[:newcomers]
