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
- **Everyone takes the deepest split held in band**: a node's target is the largest split
  among those live peers announce in their signed heartbeats (`group_bits`) and its own,
  counting only splits its own census bears; a newcomer's candidate is its census's own
  split (no hysteresis), so a node that reads the whole swarm lifts the founders that
  decided from a few heartbeats. Replicas with the same census take the same maximum, and
  every split in band is a fixed point, so once they hold it nobody moves.
- **When a node moves**: up at once; down only when the census no longer bears its split:
  at once (once per epoch) to a split a peer holds in band, otherwise at an epoch's first
  round after `patience` rounds (a census that dips for a read or two merges nothing).
- **A newcomer whose peers all hold splits its census does not bear waits** (no grouping,
  its pseudo-gradient kept) up to `patience` rounds for its census to fill, instead of
  forming a group of its own from a partial census; then its own census decides.

Trust: an announcement counts only from a live peer's verified heartbeat (the caller's
census), and only when this node's own census bears it: a stranger can make the swarm take
the deepest split hysteresis would keep for the census, never a deeper one, and cannot pull
it down at all (a split in band is never left for a shallower one; at 1000 peers and
`--group-size 8` the band is 5 bits alone). A flood of heartbeats is the membership's
budget to bound, as for every census.

Agreement: once every replica's census holds the same live peers and their current
announcements, all take the same maximum M of the splits held in band; those below rise to
it at once, those above (out of band) come down to it at once: within a round of the reads
(`tests/unit/test_grouping_split.py`: within two epochs whatever the interleaving). Pure:
no network, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from dht.grouping import GroupingPolicy

PATIENCE_ROUNDS = 2
MEMORY_ROUNDS = 5
"""Rounds a census size counts for: a node's band is that of the largest census it read in
its last MEMORY_ROUNDS decisions (each a set of signed heartbeats it verified then). At load
~40 a node's live view flapped between 1 and 11 of 15 peers round to round (session 14's
N = 16 run), and splits followed the dips down and back up."""
"""Rounds a newcomer waits for its census to bear a split its peers hold (and a node whose
census no longer bears its own split waits at an epoch's start) before its census decides."""


@dataclass(frozen=True)
class SplitState:
    """What a replica carries between decisions: its split (None: none yet), whether it
    already followed a peer down this epoch, and the rounds it has waited so far."""

    bits: int | None = None
    followed_down: bool = False
    waited: int = 0
    seen: tuple[int, ...] = ()
    """The census sizes of its last decisions (at most `SplitRule.memory`)."""


class SplitRule:
    """Decides a replica's split from its census size, the splits live peers announce and
    its own state; holds no mutable state (`SplitState` is the caller's)."""

    def __init__(
        self, policy: GroupingPolicy, patience: int = PATIENCE_ROUNDS, memory: int = MEMORY_ROUNDS
    ):
        if type(patience) is not int or patience < 0:
            raise ValueError(f"patience must be an integer >= 0, got {patience!r}.")
        if type(memory) is not int or memory < 1:
            raise ValueError(f"memory must be an integer >= 1, got {memory!r}.")
        self.policy, self.patience, self.memory = policy, patience, memory

    def proven(self, state: SplitState, num_peers: int) -> int:
        """The census size this decision's band is drawn from: the largest of this one and
        the last `memory - 1` (a census that dips for a few reads moves nothing)."""
        recent = state.seen[max(len(state.seen) - self.memory + 1, 0) :]
        return max((*recent, num_peers))

    def band(self, num_peers: int) -> tuple[int, int]:
        """The splits a census of `num_peers` bears: from the bits a growing swarm reaches
        to the bits a shrinking one keeps (hysteresis' fixed points)."""
        return self.policy.bits_for(num_peers, 0), self.policy.bits_for(
            num_peers, self.policy.config.max_bits
        )

    def heard(
        self, me: str, num_peers: int, announced: Mapping[str, object]
    ) -> tuple[int | None, bool]:
        """The deepest split a live peer announces that this census bears (None: none), and
        whether any peer announces a valid split at all. Announcements that are not a split
        (not an int in [0, max_bits]) and this node's own, read back, are ignored."""
        lo, hi = self.band(num_peers)
        valid = [b for p, b in announced.items() if p != me and self.valid(b)]
        in_band = [b for b in valid if isinstance(b, int) and lo <= b <= hi]
        return max(in_band, default=None), bool(valid)

    def valid(self, bits: object) -> bool:
        return type(bits) is int and 0 <= bits <= self.policy.config.max_bits

    def next(
        self,
        state: SplitState,
        num_peers: int,
        peers_bits: int | None,
        heard: bool,
        new_epoch: bool,
    ) -> SplitState:
        """The state after one decision (one round): `bits` None means "wait, no grouping
        this round". `peers_bits`, `heard`: `heard()`'s answer; `new_epoch`: this round
        starts an epoch (or is the first decision); `num_peers`: this census's size (the
        band is `proven()`'s, and `heard()` must be asked with that)."""
        seen = (*state.seen, num_peers)[-self.memory :]
        after = self._next(state, self.proven(state, num_peers), peers_bits, heard, new_epoch)
        return replace(after, seen=seen)

    def _next(
        self,
        state: SplitState,
        num_peers: int,
        peers_bits: int | None,
        heard: bool,
        new_epoch: bool,
    ) -> SplitState:
        own = state.bits
        lo, hi = self.band(num_peers)
        if own is None:  # a newcomer: its census's own split is a candidate too
            if heard and peers_bits is None and state.waited < self.patience:
                return SplitState(None, waited=state.waited + 1)
            return SplitState(max(peers_bits or 0, self.policy.bits_for(num_peers)))
        kept = own if lo <= own <= hi else None
        candidates = [b for b in (peers_bits, kept) if b is not None]
        target = max(candidates) if candidates else self.policy.bits_for(num_peers, own)
        follows = bool(candidates)  # the target is a split someone in band holds
        down = state.followed_down and not new_epoch  # once per epoch starts again
        if target >= own:
            return SplitState(target, down)
        if follows and not new_epoch and not down:
            return SplitState(target, followed_down=True)
        if not (new_epoch or state.waited):  # leaving a split nobody holds in band: at an
            return SplitState(own, down)  # epoch's start, after `patience` rounds
        if follows or state.waited >= self.patience:
            return SplitState(target, down)
        return SplitState(own, down, state.waited + 1)
