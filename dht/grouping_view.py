"""Learner groups from the heartbeat shards: the epoch's grouping and a group's members.

Steps 1 and 2 of docs/scale.md's wiring plan, as pure code that training does not use yet:

- `EpochGrouping`: groups are re-decided once per epoch (`epoch_rounds` rounds, counted by
  the replica's credited progress so replicas agree on the round), from the peers a walk of
  the shard tree found (`dht.shard_walk.walk_tree`, N / max_records keys once per epoch), with
  the previous epoch's bits for hysteresis (`dht.grouping.GroupingPolicy`). Replicas that
  feed it the same views decide the same groups at every round.
- `group_walker` / `group_members`: a group's prefix (`bits` <= 5 bits of the peers'
  positions) is a prefix of the shard keys below it, so the keys holding a group's
  heartbeats are the subtree under its prefix, or the one leaf above it when the tree is
  shallower there. A member walks that subtree (about g / max_records keys, at most
  g + max_records heartbeats besides marks) and takes the live peers under the prefix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from dht.grouping import (
    Grouping,
    GroupingConfig,
    GroupingPolicy,
    MembershipView,
    key_prefix,
    peer_bits,
)
from dht.grouping_split import PATIENCE_ROUNDS, SplitRule, SplitState
from dht.shards import ShardConfig

if TYPE_CHECKING:  # the walk reads DHT records (hivemind): not on a node's path to its first step
    from dht.shard_walk import TreeWalker

MAX_GROUP_KEYS = 1024
"""Keys one walk of a group's subtree reads at most (a group of ~30,000 at 32 per key)."""


class EpochGrouping:
    """The grouping in force at each round: decided at an epoch's first round and kept until
    the next epoch, unless the split moves (dht.grouping_split: every replica takes the
    deepest split a live peer holds within what its census bears). Holds the last decision and
    the split's state."""

    def __init__(
        self,
        run_id: str,
        epoch_rounds: int,
        config: GroupingConfig | None = None,
        *,
        me: str = "",
        patience: int = PATIENCE_ROUNDS,
    ) -> None:
        """`me`: this node's peer id (it is in every census it decides from, and its own
        split counts as an announcement)."""
        if type(epoch_rounds) is not int or epoch_rounds < 1:
            raise ValueError(f"epoch_rounds must be an integer >= 1, got {epoch_rounds!r}.")
        self.policy = GroupingPolicy(run_id, config)
        self.rule = SplitRule(self.policy, patience)
        self.epoch_rounds, self.me = epoch_rounds, me
        self.current: Grouping | None = None
        self.split = SplitState()

    def epoch_of(self, round_: int) -> int:
        return max(round_, 0) // self.epoch_rounds

    def due(self, round_: int) -> bool:
        """Whether the grouping must be (re-)decided before `round_`: a new epoch, or none
        decided yet (a replica that started mid-epoch decides at once)."""
        return self.current is None or self.current.epoch != self.epoch_of(round_)

    def leave(self) -> None:
        """No grouping in force (a census too small for one, dht.grouping_mode): nothing
        announced, and the next round decides afresh. The split's state is kept."""
        self.current = None

    def decide(
        self, round_: int, peers: Iterable[str], announced: Mapping[str, object] | None = None
    ) -> Grouping | None:
        """The grouping of `round_`'s epoch from the peers the epoch's census found (this
        node included) and the splits live peers announce in their heartbeats (peer id ->
        bits); None while this node waits for its census to bear the split its peers hold
        (a newcomer, at most `patience` rounds). Within an epoch the first decision's list
        stands unless the split moves (session 14: one split on every replica) or peers read
        since change which groups are merged (`_recut`)."""
        epoch = self.epoch_of(round_)
        view = MembershipView.of(epoch, peers)
        new_epoch = self.due(round_)
        proven = self.rule.proven(self.split, len(view.peers))
        peers_bits, heard = self.rule.heard(self.me, proven, announced or {})
        self.split = self.rule.next(self.split, len(view.peers), peers_bits, heard, new_epoch)
        bits = self.split.bits
        if bits is None:
            return None
        current = self.current
        if current is None or new_epoch or current.bits != bits:
            current = self.current = self.policy.at_bits(view, bits)
        else:
            current = self.current = self._recut(current, view, bits)
        return current

    def _recut(self, current: Grouping, view: MembershipView, bits: int) -> Grouping:
        """Within an epoch: the grouping of every peer listed or read since its start, where
        newly read peers grow the groups as decided or change which groups are merged
        (dht.grouping.MIN_MEMBERS). A census that missed some peers at the epoch's start (a
        member read a few seconds late, a group merged for want of them, or one missed
        whole) takes the full census's groups once it reads them; a census that misses peers
        later moves nothing (lists only grow within an epoch). Session 24: two members whose
        first censuses missed each other never heal by the senders alone (neither sends to
        the other), so the census grows the lists too. A group new to this replica without a
        merge on either side stays out of its grouping (the learner count stays the epoch's)
        while the groups it holds grow."""
        listed = frozenset(p for group in current.members.values() for p in group)
        if view.peers <= listed:
            return current
        recut = self.policy.at_bits(MembershipView(current.epoch, listed | view.peers), bits)
        if merged(recut) or merged(current):
            return recut
        grown = {key: recut.members[key] for key in current.members}  # unmerged: all there
        return current if grown == current.members else Grouping(current.epoch, bits, grown)


def merged(grouping: Grouping) -> bool:
    """Whether some group of `grouping` is merged above its split (its key is shallower)."""
    return any(len(key_prefix(k) or "") < grouping.bits for k in grouping.members)


def group_prefix(run_id: str, peer_id: str, bits: int) -> str:
    return peer_bits(run_id, peer_id)[:bits]


def group_walker(
    run_id: str, prefix: str, leaf_depth: int, config: ShardConfig | None = None
) -> TreeWalker | None:
    """The walk that reads a group's heartbeats, for a member whose own leaf is `leaf_depth`
    deep: None when that leaf lies at or above the group's prefix (it holds the whole group,
    and the member reads it every poll anyway), else the subtree under the prefix."""
    config = config or ShardConfig()
    if leaf_depth <= len(prefix):
        return None
    from dht.shard_walk import TreeWalker  # hivemind's records (tests/unit/test_start_imports)

    return TreeWalker(run_id, root=prefix, max_keys=MAX_GROUP_KEYS, max_depth=config.max_depth)


def group_members(run_id: str, prefix: str, alive: Iterable[str]) -> list[str]:
    """The live peers of the group `prefix` (sorted): those whose position starts with it."""
    return sorted({p for p in alive if peer_bits(run_id, p).startswith(prefix)})
