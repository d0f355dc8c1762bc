"""Whether a group-mode node's round goes to a learner group, out as its own update, or waits.

Session 25 (docs/scale.md, phase25): `MIN_MEMBERS` (dht.grouping) merges a prefix of fewer
than three peers into its parent, but the root cannot merge further, so a census of two was
one group of two, where either member voids the other's rounds (docs/trust.md); and a census
smaller than `--group-size` formed no group at all, so a swarm of two (or of three with
`--group-size 4`) trained one model per node: each node's rounds piled up in its residual and
nothing was ever applied. What a user expects of a swarm too small for a group is what
groups off do: each node publishes its own signed update (`SOLO`), which every replica
weighs and applies like any update. The choice is a function of the census alone (its size
and which peers in it announce a grouping), so nodes holding one census decide it alike.

A node that reads fewer peers than its swarm holds (a restart before its census has filled,
a first read at start-up, a dip) must not publish updates of its own into a swarm of groups:
while any peer it reads announces a grouping it waits (`WAIT`) as before, and it goes `SOLO`
only from its second consecutive decision whose census bears no group. A node that leaves
its grouping for want of peers stops announcing one (node.group_publishing), so two
survivors of a group both go `SOLO` within two rounds of each other.
"""

from __future__ import annotations

from enum import Enum

from dht.grouping import MIN_MEMBERS


class RoundMode(Enum):
    GROUP = "group"
    """Decide the epoch's grouping and contribute to this node's group's round."""
    SOLO = "solo"
    """Publish this round as this node's own update, as with groups off."""
    WAIT = "wait"
    """Neither: the round's pseudo-gradient stays in the residual for a later round."""


def round_mode(
    num_peers: int, group_size: int, num_grouped: int, small_before: bool = True
) -> RoundMode:
    """At a grouping's decision: `num_peers` in this node's census (itself included),
    `group_size` the run's `--group-size`, `num_grouped` the peers of the census (not this
    node) whose heartbeats announce a grouping, `small_before` whether this node's previous
    decision, too, found a census too small for a group.

    A census of at least `max(group_size, MIN_MEMBERS)` forms groups; a node alone with
    `--group-size 1` is its own group of one (no other member to void it); a census of two
    or more below that publishes `SOLO` when the previous decision's was too small as well
    and no peer in it announces a grouping (else this node's census may be short of its
    swarm, a first read at start-up or a dip: `WAIT`, one round); a node alone waits."""
    if num_peers < 1 or group_size < 1 or num_grouped < 0:
        raise ValueError("a census holds this node; group sizes and counts are positive.")
    if forms_group(num_peers, group_size):
        return RoundMode.GROUP
    if num_peers >= 2 and num_grouped == 0 and small_before:
        return RoundMode.SOLO
    return RoundMode.WAIT


def forms_group(num_peers: int, group_size: int) -> bool:
    """Whether a census of `num_peers` (this node included) bears a learner group."""
    return num_peers >= max(group_size, MIN_MEMBERS) or num_peers == group_size == 1
