"""The whole swarm at a glance: swarm-wide aggregates and pages of peers.

`status` and the dashboard read every heartbeat of a run (the observer walks the shard tree:
N / max_records keys), but what they hand a person (a terminal, a browser) is bounded: the
aggregates below, whose size does not grow with the swarm (the shard directory grows as
N / max_records entries), and one page of peers. Pure: heartbeats in, figures out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dht.grouping import GroupingPolicy, MembershipView
from dht.heartbeat import STATES, Heartbeat, count_learners

QUANTILES = (0.0, 0.1, 0.5, 0.9, 1.0)


@dataclass(frozen=True)
class Quantiles:
    """Nearest-rank quantiles of one figure over the peers that report it."""

    count: int
    values: dict[float, float]
    """Quantile (0 min, 0.5 median, 1 max) -> value."""

    @classmethod
    def of(
        cls, values: Iterable[float], quantiles: Sequence[float] = QUANTILES
    ) -> Quantiles | None:
        ordered = sorted(values)
        if not ordered:
            return None
        top = len(ordered) - 1
        return cls(len(ordered), {q: ordered[round(q * top)] for q in quantiles})


@dataclass(frozen=True)
class SwarmSummary:
    """Aggregates over the peers read, the same whether 3 or 3,000 of them."""

    peers: int
    learners: int
    """Peers that count as learners today (`dht.membership.count_learners`: not idle, and
    some peer seen has merged one of their updates)."""
    groups: int
    """Learner groups these peers would form (`dht.grouping`, default sizes): the learner
    count once groups are wired into training (docs/scale.md)."""
    group_bits: int
    states: dict[str, int]
    """State -> peers in it (every state of `dht.heartbeat.STATES`, zeros included)."""
    loss: Quantiles | None
    val_loss: Quantiles | None
    rounds: Quantiles | None
    shards: dict[str, int] = field(default_factory=dict)
    """Shard prefix -> heartbeats read there (the directory the observer walked)."""
    lost: int = 0
    """Updates the peers declared lost (no live holder), summed over their heartbeats."""
    need_state: int = 0
    """Updates the peers wait for a state to bring (no live holder, applied by a live
    state-serving peer: not lost), summed over their heartbeats."""
    peers_need_state: int = 0
    """Peers waiting for a state for at least one update."""


def summarize(
    run_id: str, heartbeats: Sequence[Heartbeat], shards: dict[str, int] | None = None
) -> SwarmSummary:
    """One pass over the heartbeats (plus sorting for the quantiles and the groups)."""
    merged = {author for h in heartbeats for author, n in h.merged_by_author.items() if n > 0}
    grouping = GroupingPolicy(run_id).decide(MembershipView.of(0, (h.peer_id for h in heartbeats)))
    states = Counter(h.state for h in heartbeats)
    return SwarmSummary(
        peers=len(heartbeats),
        learners=count_learners(heartbeats, merged.__contains__),
        groups=grouping.num_learners,
        group_bits=grouping.bits,
        states={state: states.get(state, 0) for state in STATES},
        loss=Quantiles.of(h.loss for h in heartbeats if h.loss is not None),
        val_loss=Quantiles.of(h.val_loss for h in heartbeats if h.val_loss is not None),
        rounds=Quantiles.of(float(h.round) for h in heartbeats),
        shards=dict(sorted((shards or {}).items())),
        lost=sum(h.num_lost for h in heartbeats),
        need_state=sum(h.num_need_state for h in heartbeats),
        peers_need_state=sum(h.num_need_state > 0 for h in heartbeats),
    )
