"""One split (`bits`) on every replica, whatever order and pace peers joined in (session 14).

Session 13's real run at N = 16 (`--group-size 4`) held three splits side by side
(`groups.0b`, `groups.0b0`, `groups.0b1`): each node decided its first epoch from the few
heartbeats it had read while 16 processes started at load ~40, and hysteresis then held each
where its first census put it. Every value hysteresis would keep is a fixed point, so
replicas that started apart stay apart: the split needs agreeing, not only computing.

The rule (`SplitRule`):

- **A census bears a band of splits**: `band(n)` = [the bits a swarm growing to n peers
  reaches, the bits a swarm shrinking to n keeps] (the fixed points of
  `GroupingPolicy.bits_for(n, .)`; at `--group-size 4`, 16 peers bear 1 or 2 bits).
- **Everyone follows one announcer**: the *leader* is the live peer with the lowest position
  (`dht.grouping.peer_bits`, from its id alone) among those whose signed heartbeat announces
  a split, this node included once it holds one. Its split, clamped into this node's band,
  is the node's target (`bits_for(n, leader's bits)`). Replicas with the same census pick
  the same leader and the same target; the leader's own split is its hysteresis state, so
  it stays put while the census stays in band and the swarm stays with it.
- **When it moves**: up at once (the census grew past a split line, or the leader splits
  deeper within the band); down to the leader at once but once per epoch (a restarted node
  or an early founder rejoins the swarm's split within a round), otherwise down only at an
  epoch's first round (a census that drops for a read or two does not merge groups).
- **A newcomer whose census does not bear the leader's split waits** (no grouping, its
  pseudo-gradient kept) up to `patience` rounds for its census to fill, instead of forming
  a group of its own from a partial census; so does a node about to lower at an epoch's
  start away from the leader. After `patience` rounds its own census decides.

Trust: an announcement counts only from a live peer's verified heartbeat (the caller's
census), and moves a node only within the band its own census bears: a stranger with a
ground peer id (the lowest position) can choose among the splits hysteresis would keep for
the census, never a deeper one (and a flood of heartbeats is the membership's budget to
bound, as for every census). Toggling within the band moves a follower up at once and down
at most once per epoch plus once at its start: bounded churn, not a stall.

Agreement: once every replica's census holds the same live peers and their current
announcements, all pick one leader L; if L's split is in the band, every follower is on it
within one round up, or within the epoch (once per epoch: at once) down; if it is not, L
itself moves into the band (up at once, down at its next epoch), and the followers with it:
at most two epochs after the censuses agree (`tests/unit/test_grouping_split.py`). Pure: no
network, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dht.grouping import GroupingPolicy, peer_bits

PATIENCE_ROUNDS = 2
"""Rounds a newcomer (or a node about to leave the leader's split) waits for its census to
bear the leader's split before its own census decides."""


@dataclass(frozen=True)
class SplitState:
    """What a replica carries between decisions: its split (None: none yet), whether it
    already followed the leader down this epoch, and the rounds it has waited so far."""

    bits: int | None = None
    followed_down: bool = False
    waited: int = 0


class SplitRule:
    """Decides a replica's split from its census size, the splits live peers announce and
    its own state; holds no mutable state (`SplitState` is the caller's)."""

    def __init__(self, run_id: str, policy: GroupingPolicy, patience: int = PATIENCE_ROUNDS):
        if type(patience) is not int or patience < 0:
            raise ValueError(f"patience must be an integer >= 0, got {patience!r}.")
        self.run_id, self.policy, self.patience = run_id, policy, patience

    def band(self, num_peers: int) -> tuple[int, int]:
        """The splits a census of `num_peers` bears: from the bits a growing swarm reaches
        to the bits a shrinking one keeps (hysteresis' fixed points)."""
        return self.policy.bits_for(num_peers, 0), self.policy.bits_for(
            num_peers, self.policy.config.max_bits
        )

    def leader(self, me: str, own: int | None, announced: Mapping[str, object]) -> int | None:
        """The split of the lowest-positioned announcer (this node included when it holds
        one); announcements that are not a valid split are ignored. None: no one announces."""
        valid = {p: b for p, b in announced.items() if p != me and self.valid(b)}
        if own is not None:
            valid[me] = own
        if not valid:
            return None
        first = min(valid, key=lambda p: (peer_bits(self.run_id, p), p))
        bits = valid[first]
        assert isinstance(bits, int)
        return bits

    def valid(self, bits: object) -> bool:
        return type(bits) is int and 0 <= bits <= self.policy.config.max_bits

    def next(
        self,
        state: SplitState,
        num_peers: int,
        leader: int | None,
        new_epoch: bool,
    ) -> SplitState:
        """The state after one decision (one round): `bits` None means "wait, no grouping
        this round". `new_epoch`: this round starts an epoch (or the first decision)."""
        own = state.bits
        target = self.policy.bits_for(num_peers, own if leader is None else leader)
        follows = leader is None or target == leader
        if own is None:
            if follows or state.waited >= self.patience:
                return SplitState(target)
            return SplitState(None, waited=state.waited + 1)
        down = state.followed_down and not new_epoch  # once per epoch starts again
        if target >= own:
            return SplitState(target, down)
        if follows and not new_epoch and not down:
            return SplitState(target, followed_down=True)
        if not (new_epoch or state.waited):  # lowering away from the leader: at an epoch's start
            return SplitState(own, down)
        if follows or state.waited >= self.patience:
            return SplitState(target, down)
        return SplitState(own, down, state.waited + 1)
