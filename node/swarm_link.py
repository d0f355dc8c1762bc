"""What the training loop needs of the swarm, with two kinds: the network and none at all.

`node.swarm_start.StartingSwarm` is the network's swarm, started beside training (it wraps
`node.network_swarm.NetworkSwarm` once that is up); `OfflineSwarm` is a node that trains alone
(`join --no-swarm`, benchmarks): it publishes nowhere and sees no peers. The composition root
picks one, so nothing else asks whether there is a swarm. Nothing here imports hivemind.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from dht.grouping_round import GroupRound
from dht.grouping_shards import ShardedRound
from dht.heartbeat import MAX_AUTHORS, Heartbeat
from dht.reachability import PathKind
from dht.realign_config import SETTLE_TOLERANCE
from dht.transfer_progress import ProgressReport
from merge.envelope import SignedUpdate
from merge.group_update import Abandoned, ContributionHeader, GroupUpdate, ReductionConfig
from merge.identity import Identity
from merge.sketch import relative_distance
from node.snapshot import PeerSighting

DRAIN_TIMEOUT_S = 15.0
"""How long a stopping node waits for its own update to be announced and pushed to peers."""


@dataclass(frozen=True)
class GroupContribution:
    """This node's signed contribution to one learner-group round (node.group_publishing)."""

    identity: Identity
    header: ContributionHeader
    pseudo_gradient: torch.Tensor
    members: tuple[str, ...]
    """The group's members this epoch (this node among them)."""
    wait_s: float
    """The deadline, from now: who is not in by then is left out."""
    cosign_s: float
    """After the deadline, how long co-signatures may take before the round is abandoned."""
    config: ReductionConfig
    codec: str = "fp32"
    """What the part travels in: `pseudo_gradient` is already what that codec decodes to."""
    payload: bytes | None = None
    """`pseudo_gradient` encoded in `codec`, when at hand (sent as is)."""
    digests: tuple[str, ...] = ()
    """--group-scatter: the part's shard digests (the header signs their root); the round
    runs by reduce-scatter (dht.grouping_shards). Empty: whole parts."""


def run_alone(contribution: GroupContribution) -> GroupUpdate | Abandoned:
    """The round of a group with no reachable member but this node: a group of one
    completes at once (more members, none reachable: below quorum, abandoned)."""
    c = contribution
    if c.digests:
        sharded = ShardedRound(
            c.identity, c.header, c.digests, c.pseudo_gradient, c.members,
            opened_at=time.monotonic(), wait_s=0.0, cosign_s=0.0, config=c.config,
        )  # fmt: skip
        sharded.tick(time.monotonic())
        sharded.tick(time.monotonic())
        assert isinstance(sharded.outcome, (GroupUpdate, Abandoned))  # a group of one: not folded
        return sharded.outcome
    member = GroupRound(
        c.identity, c.header, c.pseudo_gradient, c.members, opened_at=time.monotonic(),
        wait_s=0.0, cosign_s=0.0, config=c.config,
    )  # fmt: skip
    member.tick(time.monotonic())
    member.tick(time.monotonic())
    outcome = member.outcome
    assert outcome is not None
    return outcome


class SwarmLink(Protocol):
    """The swarm as the training loop, the telemetry and the node's lifecycle see it."""

    def join(self, joined: Callable[[int], None]) -> None:
        """Enter the swarm and catch up, waiting for both, on the calling (main) thread."""

    def begin(self, joined: Callable[[int], None], forked: Callable[[], None]) -> None:
        """Start entering the swarm beside training; returns at once. p2pd and the DHT's
        bootstrap run in the background, the DHT's process forks at the next `step_boundary`,
        then `forked()` runs, then the state check (download if a peer is ahead) and gossip;
        `joined(announced_seq)` runs once the state is in, before gossip."""

    def step_boundary(self) -> None:
        """Called by the training thread between inner steps, where it holds no lock: the one
        moment the DHT's process may fork. Raises what made the start fail."""

    def wait_caught_up(self, stop: threading.Event) -> bool:
        """Until the state check has ended (at once if `begin` never ran); False if `stop`
        came first. Raises what made it fail."""

    def caught_up(self) -> bool:
        """Whether the state check has ended, at once, without waiting (True if `begin`
        never ran): a finished round set aside is published then (node.trainer). Raises what
        made it fail."""

    def alive_peers(self) -> list[Heartbeat]: ...

    def live_learners(self) -> int:
        """M: this node and its live peers that learn (what its updates are sized by)."""

    def publish(self, update: SignedUpdate) -> bool:
        """Send one of our merged updates to peers; False when there is nobody to send to."""

    def contribute(self, contribution: GroupContribution) -> GroupUpdate | Abandoned:
        """Learner groups: this node's contribution to its group's round, exchanged with the
        other members until the deadline, reduced and co-signed (dht.group_exchange); the
        group's update, or Abandoned. Blocks until the round has an outcome (bounded)."""

    def pass_on_evidence(self, update: GroupUpdate) -> None:
        """A valid second variant of a group round this node applied a variant of (its own
        group's outcome refused as `group_equivocation`): the proof the two make goes to the
        swarm, as for one pushed by a peer (dht.gossip_evidence)."""

    def group_round(self, group_key: str) -> int:
        """The highest round a member of `group_key` was seen contributing to (-1: none), so
        a node behind its group (a newcomer, a restart) joins the group's current round."""

    def group_senders(self, group_key: str, epoch: int) -> Mapping[str, int]:
        """The live peers inside `group_key` that sent this node a verified part or piece for
        `epoch` (dht.grouping_census): what this node's member list heals from, each with the
        highest round it sent one of (what keeps it listed)."""

    def linger(self, seconds: float, until_done: bool, stop: threading.Event) -> None:
        """Keep serving and merging after the last round (--linger)."""

    def leave(self) -> None:
        """Let our updates in flight out (bounded), then stop every network process."""

    def num_lost(self) -> int: ...

    def num_need_state(self) -> int:
        """Wanted updates no live peer offers that wait for a state download (not lost)."""

    def fresh_peers_set_aside(self) -> int:
        """Live peers without an applied record here that `alive_peers` left out at its
        last call (dht.membership.established_view): fresh keys beyond the bound."""

    def paths(self) -> dict[PathKind, int]:
        """Open connections to peers by path: direct, holepunched, relayed."""

    def rejections(self) -> dict[str, int]:
        """Counted rejections of peer input by the network layer."""

    def visible_maddrs(self) -> list[str]: ...

    def state_download(self) -> ProgressReport | None:
        """The running state download: bytes, rate, ETA (None: none running)."""

    def sightings(self, now: float) -> tuple[PeerSighting, ...]: ...

    def fetched(self) -> tuple[int, int]:
        """Payloads fetched from peers (bounded history) and their bytes."""


class OfflineSwarm:
    """No network: the node trains alone; every answer is that of an empty swarm."""

    def join(self, joined: Callable[[int], None]) -> None:
        """Nothing to join."""

    def begin(self, joined: Callable[[int], None], forked: Callable[[], None]) -> None:
        """Nothing to enter: what waits for the fork starts now."""
        forked()

    def step_boundary(self) -> None:
        """Nothing forks."""

    def wait_caught_up(self, stop: threading.Event) -> bool:
        return True

    def caught_up(self) -> bool:
        return True

    def alive_peers(self) -> list[Heartbeat]:
        return []

    def live_learners(self) -> int:
        return 1

    def publish(self, update: SignedUpdate) -> bool:
        return False

    def contribute(self, contribution: GroupContribution) -> GroupUpdate | Abandoned:
        return run_alone(contribution)

    def pass_on_evidence(self, update: GroupUpdate) -> None:
        """Nobody to tell."""

    def group_round(self, group_key: str) -> int:
        return -1

    def group_senders(self, group_key: str, epoch: int) -> Mapping[str, int]:
        return {}

    def linger(self, seconds: float, until_done: bool, stop: threading.Event) -> None:
        """Nobody to wait for."""

    def leave(self) -> None:
        """Nothing to leave."""

    def num_lost(self) -> int:
        return 0

    def num_need_state(self) -> int:
        return 0

    def fresh_peers_set_aside(self) -> int:
        return 0

    def paths(self) -> dict[PathKind, int]:
        return {}

    def rejections(self) -> dict[str, int]:
        return {}

    def visible_maddrs(self) -> list[str]:
        return []

    def state_download(self) -> ProgressReport | None:
        return None

    def sightings(self, now: float) -> tuple[PeerSighting, ...]:
        return ()

    def fetched(self) -> tuple[int, int]:
        return 0, 0


def peers_finished(
    peers: list[Heartbeat],
    last_seq: Callable[[str], int],
    own_id: str,
    own_updates: int,
    merged_here: Mapping[str, int] | None = None,
    settled_here: tuple[str, Sequence[float]] | None = None,
) -> bool:
    """Whether every peer has stopped training (idle), its last update is applied here and,
    by its heartbeat, our ``own_updates`` updates are applied there. A peer that published
    no update of its own (latest seq 0: a learner-group member, whose group's updates are
    under the group key) has none to wait for. With ``merged_here`` (this replica's count of
    applied updates per author), also none of the authors a peer's heartbeat lists as merged
    there has fewer here, nor the reverse (`same_merged`): a learner group's last update,
    completed by some members as the others finished, reaches every member before they leave
    (session 24: in test_groups survivors left without their group's last update, which the
    others applied; the one behind must still find a live holder). With ``settled_here``
    (this replica's applied digest and settled sketch), also no peer at that digest whose
    sketch lies apart beyond float rounding (`same_point`): replicas of one applied set that
    hold different points stay until the settle (dht.realign_settle) made them one (CI,
    session 25: test_groups' survivors left at one applied set, one of them 1.4e-2 apart, two
    variants of a root-group round each applied on a side). Bounded by --linger."""
    return all(
        h.state == "idle"
        and (h.latest_seq == 0 or last_seq(h.peer_id) >= h.latest_seq)
        and h.merged_by_author.get(own_id, 0) >= own_updates
        and (merged_here is None or same_merged(h, merged_here))
        and (settled_here is None or same_point(h, *settled_here))
        for h in peers
    )


def same_point(peer: Heartbeat, digest: str, sketch: Sequence[float]) -> bool:
    """Whether `peer`, when its heartbeat shows this replica's applied `digest`, holds this
    replica's settled point up to float rounding (its sketch within SETTLE_TOLERANCE); a
    peer elsewhere, or one whose sketch cannot be compared, says nothing against it."""
    if not digest or peer.applied_digest != digest:
        return True
    distance = relative_distance(list(peer.sketch), list(sketch))
    return distance is None or distance <= SETTLE_TOLERANCE


def same_merged(peer: Heartbeat, merged_here: Mapping[str, int]) -> bool:
    """Whether `peer`'s heartbeat lists no author with more updates merged than this replica
    holds and, when its list is whole (under MAX_AUTHORS), none with fewer: neither side
    leaves the other short (the one ahead stays to serve it)."""
    theirs = peer.merged_by_author
    if any(merged_here.get(a, 0) < n for a, n in theirs.items()):
        return False
    return len(theirs) >= MAX_AUTHORS or all(theirs.get(a, 0) >= n for a, n in merged_here.items())
