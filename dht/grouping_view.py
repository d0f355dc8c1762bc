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

from collections.abc import Iterable
from typing import TYPE_CHECKING

from dht.grouping import Grouping, GroupingConfig, GroupingPolicy, MembershipView, peer_bits
from dht.shards import ShardConfig

if TYPE_CHECKING:  # the walk reads DHT records (hivemind): not on a node's path to its first step
    from dht.shard_walk import TreeWalker

MAX_GROUP_KEYS = 1024
"""Keys one walk of a group's subtree reads at most (a group of ~30,000 at 32 per key)."""


class EpochGrouping:
    """The grouping in force at each round: decided at an epoch's first round, kept until the
    next epoch. Holds only the last decision (for its bits: the hysteresis)."""

    def __init__(
        self, run_id: str, epoch_rounds: int, config: GroupingConfig | None = None
    ) -> None:
        if type(epoch_rounds) is not int or epoch_rounds < 1:
            raise ValueError(f"epoch_rounds must be an integer >= 1, got {epoch_rounds!r}.")
        self.policy = GroupingPolicy(run_id, config)
        self.epoch_rounds = epoch_rounds
        self.current: Grouping | None = None

    def epoch_of(self, round_: int) -> int:
        return max(round_, 0) // self.epoch_rounds

    def due(self, round_: int) -> bool:
        """Whether the grouping must be (re-)decided before `round_`: a new epoch, or none
        decided yet (a replica that started mid-epoch decides at once)."""
        return self.current is None or self.current.epoch != self.epoch_of(round_)

    def decide(self, round_: int, peers: Iterable[str], announced: Iterable[int] = ()) -> Grouping:
        """The grouping of `round_`'s epoch from the peers the epoch's census found (this
        node included), and the bits live peers announced in their heartbeats (settled_bits).
        Within an epoch the first decision stands (a later call returns it) unless live
        peers announce more bits than it has that this census bears: a replica whose first
        census was partial then re-decides at once, from this census, instead of keeping a
        group of its own for the rest of the epoch (session 13: bits only rise mid-epoch)."""
        epoch = self.epoch_of(round_)
        view = MembershipView.of(epoch, peers)
        alone, kept = self.policy.bits_for(len(view.peers)), self.kept_bits(len(view.peers))
        current = self.current
        if current is not None and current.epoch == epoch:
            raised = settled_bits(current.bits, announced, alone, kept)
            if raised > current.bits:
                current = self.current = self.policy.decide(view, raised)
            return current
        own = None if current is None else current.bits
        self.current = self.policy.decide(view, settled_bits(own, announced, alone, kept))
        return self.current

    def kept_bits(self, num_peers: int) -> int:
        """The most bits a census of `num_peers` bears: those hysteresis would keep (a split
        stands until its groups fall below (1 - hysteresis) x min_group_size), at least the
        bits it would decide alone. The peers that split at N keep the split down to 3/4 N,
        so a replica that (re)joins with a census there follows them (session 13: a node
        restarted into a census of 7 of 8 formed a group of its own for the whole epoch)."""
        return self.policy.bits_for(num_peers, self.policy.config.max_bits)


def settled_bits(
    own: int | None, announced: Iterable[int], target: int, cap: int | None = None
) -> int:
    """The bits carried into an epoch's decision (its hysteresis start): this node's previous
    bits (its census's `target`, without hysteresis, at its first decision), raised to the
    largest bits a live peer announced that this node's own census also bears (at most
    `cap`: `target` unless given; `EpochGrouping.kept_bits` since session 13). A replica
    whose earlier census was partial (it decided before it had read every heartbeat) so
    follows one that saw the swarm, instead of being held below the split by hysteresis for
    good; a peer cannot announce more groups than the census bears, and announcements never
    lower the bits (only this node's own hysteresis does)."""
    start = target if own is None else own
    cap = target if cap is None else cap
    best = max((b for b in announced if type(b) is int and 0 <= b <= cap), default=start)
    return max(start, best)


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
