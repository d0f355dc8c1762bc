"""The simulator's state: its settings, a replica, a node, a published group update.

Kept apart from bench.scale_sim, which runs them; see that module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dht.catchup import CatchUp, CatchUpConfig
from dht.ranges import UpdateId
from merge.group_update import GroupUpdate, ReductionConfig
from merge.identity import Identity
from merge.outer import OuterConfig, OuterOptimizer, make_outer_optimizer
from merge.robust import RobustConfig, RobustFilter

CATCH_UP = CatchUpConfig(lost_after_s=180.0, retry_s=5.0, max_in_flight=256)
"""Each group replica's catch-up: an update no live peer offers for 3 rounds is lost."""


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    rounds: int = 10
    """Training rounds; then `linger_rounds` with no publishing, for catch-up."""
    linger_rounds: int = 3
    epoch_rounds: int = 4
    """Groups are re-decided every this many rounds."""
    round_s: float = 60.0
    heartbeat_period_s: float = 10.0
    sample_shards: int = 2
    """Shards beyond its group's one node reads per heartbeat period (the swarm-wide view)."""
    kill_rate: float = 0.01
    """Per node per round: kill -9 (a fifth of them while reducing)."""
    freeze_rate: float = 0.01
    """Per node per round: a freeze of one to two rounds (a fifth while reducing)."""
    join_rate: float = 0.01
    """Newcomers per node per round."""
    dim: int = 64
    """Length of the simulated pseudo-gradients (bytes are counted at tiny's size)."""
    latency_s: float = 0.05
    tokens_per_round: int = 16 * 128 * 5
    dishonest_share: float = 0.0
    """Share of peers that contribute -20x their honest pseudo-gradient (well signed)."""
    reduction: ReductionConfig = field(default_factory=ReductionConfig)
    seed: int = 0
    scatter: bool = False
    """Count in-group bytes message by message from merge.group_shards' reduce-scatter (the
    pieces each member sends its shards' reducers, re-sends after a loss, the reduced shards
    all-gathered with their co-signatures); without `wired`, other groups' updates come by
    the shard fetch as real nodes with --group-shard-fetch run it, each message sized by the
    real wire (bench.scale_sim_wire: proposals, parts, slices, fp32 sums; session 26)."""
    wired: bool = False
    """Count bytes as real nodes move them as of session 11 (docs/scale.md): each member sends
    its whole part (bf16) to every other member, and every node fetches each other group's
    whole update once (bf16), with no all-gather. False: the design's reduce-scatter, shard
    fetches and all-gather. Only the bytes differ; timings are the design's either way."""
    sums_width: int = 4
    """With `scatter` (not `wired`): bytes per value of the fetch round's weighted sums, 4 as
    real nodes send them (fp32, session 24); 2 counts bf16 sums (the option session 24 left:
    groups ~4e-4 apart, a state download each at the end)."""
    group_size: int = 0
    """The grouping policy's target group size (dht.grouping `GroupingConfig.min_group_size`,
    as join's --group-size sets it); 0: the policy's default (8)."""
    balanced: bool = False
    """The first nodes' identities spread evenly over the groups (bench.scale_keys, as
    `bench.scale --balanced` gives real nodes), so a row is like for like with a real run."""
    fold_own: bool = True
    """With `scatter` (not `wired`), at two learners or more: the own group's update joins
    its members' fetch round as one more candidate instead of being all-gathered, as real
    nodes with --group-fold do since session 29 (fold29; counted since session 27, levers27):
    the reducers send each other seals (digest and co-signature), not shards; each reducer
    (and `fold_own_replicas` - 1 members after it) then holds the only copies of its shard,
    so every slice or whole fetch of the update asks each shard's holder
    (bench.scale_sim_levers). False: the all-gather (`bench.scale --all-gather-own`)."""
    fold_own_replicas: int = 2
    """With `fold_own`: members holding each reduced shard (its reducer and the next r - 1
    included members, sent the shard inside the round; merge.shard_holders' SHARD_REPLICAS)."""
    second_sum: bool = True
    """With `scatter` (not `wired`): the updates past a Delayed Nesterov fold inside a fetch
    round go into a second (or third) weighted sum of the same round (`decide` without
    `until_fold`: merge.shard_round_replay `combos_of` takes at most 3, the wire's
    MAX_SUMS), as real nodes do since session 27 (second27); False counts them fetched whole
    by every member, as sessions 18-26 did (`bench.scale --whole-past-fold`)."""

    def __post_init__(self) -> None:
        if self.sums_width not in (2, 4):
            raise ValueError(f"sums_width is 2 (bf16) or 4 (fp32), got {self.sums_width!r}.")
        if self.group_size < 0 or self.group_size == 2:
            raise ValueError(f"group_size is 0, 1 or >= 3 (join refuses 2), got {self.group_size}.")
        if self.fold_own_replicas < 1:
            raise ValueError(f"fold_own_replicas is >= 1, got {self.fold_own_replicas}.")


@dataclass(eq=False)
class SimReplica:
    """One replica: params, outer optimizer, robust window, applied ids with their times."""

    params: torch.Tensor
    outer: OuterOptimizer
    robust: RobustFilter
    applied: dict[str, float] = field(default_factory=dict)
    applied_ids: set[UpdateId] = field(default_factory=set)
    """The applied set as dht.catchup counts it: (group key, round)."""
    inflight: set[str] = field(default_factory=set)
    fold_window: int | None = None
    """The last round window a fetch round folded in (bench.scale_sim_deliver `_deferred`)."""
    window_folds: int = 0
    """Delayed Nesterov folds in `fold_window` so far."""
    window_tail: bool = False
    """Whether an update was applied in `fold_window` after its last fold
    (`SimConfig.second_sum`: then the round's state needs one more sum)."""
    sums_members: list[SimNode] = field(default_factory=list)
    """The live members that took the latest update past a fold in `fold_window`."""
    catch_up: CatchUp = field(init=False)
    """The project's catch-up decisions (what to fetch, from whom, what is lost)."""

    def __post_init__(self) -> None:
        self.catch_up = CatchUp(CATCH_UP, f"replica-{id(self)}", self)

    def has_applied(self, author: str, seq: int) -> bool:
        return (author, seq) in self.applied_ids

    @classmethod
    def fresh(cls, dim: int) -> SimReplica:
        return cls(
            torch.zeros(dim), make_outer_optimizer(OuterConfig(), dim), RobustFilter(RobustConfig())
        )

    def copy(self) -> SimReplica:
        outer = make_outer_optimizer(OuterConfig(), self.params.numel())
        outer.load_state_dict(self.outer.state_dict())
        robust = RobustFilter(self.robust.config)
        robust.load_state_dict(self.robust.state_dict())
        return SimReplica(
            self.params.clone(), outer, robust, dict(self.applied), set(self.applied_ids)
        )


@dataclass(eq=False)
class SimNode:
    identity: Identity
    down_bps: float
    replica: SimReplica
    joined_at: float
    alive: bool = True
    frozen_until: float = -1.0
    received: float = 0.0
    records_read: float = 0.0
    live_s: float = 0.0
    dishonest: bool = False
    first_had: dict[str, float] = field(default_factory=dict)
    """When it first held each update it held before its latest change of replica."""

    def switch(self, replica: SimReplica, now: float) -> None:
        """Takes ``replica`` (a state download, a group's copy): what it newly gets, it gets now."""
        for update_id, at in self.replica.applied.items():
            self.first_had.setdefault(update_id, at)
        for update_id in replica.applied:
            self.first_had.setdefault(update_id, now)
        self.replica = replica

    def had_at(self, update_id: str) -> float:
        return self.first_had.get(update_id, self.replica.applied[update_id])

    @property
    def peer_id(self) -> str:
        return self.identity.peer_id

    def frozen(self, now: float) -> bool:
        return now < self.frozen_until


@dataclass
class Published:
    update: GroupUpdate
    at: float
    deadline: float
    """The end of the round it was made in; published at ``at``, after the reduction."""
    header_bytes: int
    """Wire bytes of its headers, digests and co-signatures (beside the aggregate)."""
    holders: tuple[tuple[str, ...], ...] = ()
    """With `SimConfig.fold_own`: the members holding each reduced shard, reducer first."""
    slice_meta: int = 0
    """With `SimConfig.fold_own`: a `group-slice` answer's bytes beside its tensors
    (bench.scale_sim_wire `slice_meta`), asked of each holder."""


def catch_up_id(update: GroupUpdate) -> UpdateId:
    """An update's id as dht.catchup counts it: its group key as author, its round as seq."""
    return (update.head.group_key, update.head.round)
