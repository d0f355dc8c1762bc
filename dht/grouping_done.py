"""The `group-done` notice of a learner group round, and what a node does with one (the round
itself: dht.grouping_round; dht/group_exchange.py does the network):

- `group-done`: a small notice that a member completed a round (its id and included set),
  sent instead of the whole update: a member still waiting fetches the update from the
  notifier only when it needs it (`done_action`), a peer outside the group fetches it once
  from one holder (the gossip's catch-up), not once per pushing member. Since session 26 it
  names its variant (`variant`, merge.group_equivocation.variant_digest): a node that holds
  another variant of the round fetches this one to form the proof (dht.variant_fetches).

What travels is dht.group_notice's `SignedDone` (`DGD3` since session 28; older notices are
refused there as "old_version" or "unsigned"). `Done.to_bytes` / `decode_done` (`DGD1`) are the
unsigned notice of session 13: no node sends them since session 14, nor reads them from a peer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from dht.grouping_wire import (
    MAX_COUNT,
    MAX_MEMBERS,
    MAX_TEXT,
    GroupMessageError,
    RoundId,
    names_a_round,
)
from dht.variant_fetches import is_digest
from merge.group_equivocation import GroupVariant
from merge.group_update import (
    Abandoned,
    GroupUpdate,
    Phase,
)
from merge.shard_holders import ShardHolding

DONE_MAGIC = b"DGD1"


@dataclass(frozen=True)
class Done:
    """A member's notice that it completed a group round: the round and its included set.
    Not signed: it is a hint to fetch, and what is fetched is checked as every update is."""

    group_key: str
    epoch: int
    round: int
    included: tuple[str, ...]
    variant: str | None = None
    """The digest of the completed variant (merge.group_equivocation.variant_digest); None in
    a notice of session 25 or older."""

    @property
    def round_id(self) -> RoundId:
        return (self.group_key, self.epoch, self.round)

    @property
    def seq(self) -> int:
        """The seq replicas apply the round's update under (its group key as author)."""
        return self.round + 1

    def to_bytes(self) -> bytes:
        fields = {
            "group_key": self.group_key,
            "epoch": self.epoch,
            "round": self.round,
            "included": list(self.included),
        }
        if self.variant is not None:
            fields["variant"] = self.variant
        return DONE_MAGIC + json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def of(cls, update: GroupUpdate) -> Done:
        head = update.head
        included = tuple(h.author for h in update.contributions)
        variant = GroupVariant.of(update).digest
        return cls(head.group_key, head.epoch, head.round, included, variant)


def done_max_bytes() -> int:
    return len(DONE_MAGIC) + 256 + MAX_MEMBERS * (MAX_TEXT + 4)


def decode_done(blob: object) -> Done:
    """An untrusted `group-done` blob's fields; GroupMessageError for anything else."""
    if not isinstance(blob, bytes) or blob[:4] != DONE_MAGIC:
        raise GroupMessageError("malformed", "not a group-done notice")
    try:
        fields = json.loads(blob[4:])
        included = fields["included"]
        done = Done(
            fields["group_key"], fields["epoch"], fields["round"], tuple(included),
            fields.get("variant"),
        )  # fmt: skip
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise GroupMessageError("malformed", "a group-done notice that does not parse") from None
    ok = (
        names_a_round(done.group_key, included)
        and all(type(v) is int and 0 <= v < MAX_COUNT for v in (done.epoch, done.round))
        and (done.variant is None or is_digest(done.variant))
    )
    if not ok:
        raise GroupMessageError("malformed", "a group-done notice with fields out of range")
    return done


DONE_GRACE_S = 2.0
"""How long a member still reducing the included set a notice names waits for its own
completion (its co-signatures in flight) before it fetches the update instead."""


class _Included(Protocol):
    @property
    def included(self) -> tuple[str, ...]: ...


class RoundView(Protocol):
    """What `done_action` reads of a running round (GroupRound, or dht.grouping_shards'
    ShardedRound)."""

    @property
    def done(self) -> bool: ...
    @property
    def outcome(self) -> GroupUpdate | ShardHolding | Abandoned | None: ...
    @property
    def phase(self) -> Phase: ...
    @property
    def cosign_deadline(self) -> float: ...
    @property
    def reduction(self) -> _Included: ...


def done_action(
    member: RoundView | None,
    done: Done,
    settled: bool | None,
    now: float,
    *,
    waited: bool = False,
) -> float | str:
    """What this node does with a `group-done` notice for a round.

    `member`: this node's round of that id if it is running; `settled`: if it ran and ended
    here, whether it ended with the complete update (True) or without it (False), else None.
    Returns "ignore" (this node holds the update), "adopt" (fetch it from the notifier and
    adopt it: the round is running and cannot complete by itself, its included set differs
    or its co-signatures are late), "offer" (the gossip fetches it once from a holder, as any
    replica missing it: this node is outside the round, left out, gave up, or has not opened
    it), or a time (monotonic) to look again: the round reduces the same included set, and the
    co-signatures the notifier completed with were sent here too (`waited`: that time has
    passed, and the round is still running: "adopt")."""
    if member is not None:
        if member.done:
            done_ = isinstance(member.outcome, (GroupUpdate, ShardHolding))  # folded: held too
            return "ignore" if done_ else "offer"
        same = member.phase is Phase.REDUCING and member.reduction.included == done.included
        if same and not waited:
            return now + min(DONE_GRACE_S, max(member.cosign_deadline - now, 0.0))
        return "adopt"
    if settled:
        return "ignore"
    return "offer"
