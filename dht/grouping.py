"""Learner groups: who is in which group, decided identically on every replica.

A peer's group is the first ``bits`` bits of BLAKE2b(run id, peer id), keyed like hivemind's
averaging buckets (``groups.0b0110``). So membership in a group is checkable from a peer id
alone; only ``bits`` needs agreeing, and it is a pure function of the epoch's membership
view and the previous epoch's bits (with hysteresis, so churn near a threshold does not flip
it). A join or a leave changes no other peer's group unless it takes a group across
`MIN_MEMBERS`; a change of bits splits every group into its two children (or merges two
siblings), never moving a peer to an unrelated group.
The learner count that sizes the outer step is the number of non-empty groups. No group of
a split holds fewer than `MIN_MEMBERS` peers of the view: a smaller one is merged with its
sibling (their parent prefix), so the groups are a cut of the prefix tree whose keys may be
shallower than `bits` (docs/trust.md: in a group of two one member voids the other's every
round). Pure: no network; docs/scale.md has the design.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

GROUP_KEY_PREFIX = "groups"
MIN_MEMBERS = 3
"""Fewest peers of the view a group of a split holds (a view smaller than this is one
group). Of two complete variants of a group's round the one with more co-signers prevails,
equal counts void it (merge.group_equivocation.prevailing): in a group of two, one member
alone ties the other's round every time; in a group of three or more with all live, the
honest members' round includes at least two to its one."""


@dataclass(frozen=True, kw_only=True)
class GroupingConfig:
    """How large learner groups are; part of the run's settings (every replica uses them)."""

    min_group_size: int = 8
    """Fewest peers a group should hold on average; fewer peers than this form one group."""
    max_bits: int = 5
    """At most 2**max_bits groups (learners): 32 by default, a few dozen at any N."""
    hysteresis: float = 0.25
    """Groups split only when each child would hold (1 + hysteresis) x min_group_size on
    average, and merge only below (1 - hysteresis) x min_group_size."""

    def __post_init__(self) -> None:
        if type(self.min_group_size) is not int or self.min_group_size < 1:
            raise ValueError(
                f"min_group_size must be an integer >= 1, got {self.min_group_size!r}."
            )
        if type(self.max_bits) is not int or not 0 <= self.max_bits <= 16:
            raise ValueError(f"max_bits must be an integer in [0, 16], got {self.max_bits!r}.")
        if not isinstance(self.hysteresis, int | float) or not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis!r}.")


@dataclass(frozen=True)
class MembershipView:
    """The peers an epoch's grouping is decided from (the epoch's census)."""

    epoch: int
    peers: frozenset[str]

    @classmethod
    def of(cls, epoch: int, peers: Iterable[str]) -> MembershipView:
        return cls(epoch, frozenset(peers))


def peer_bits(run_id: str, peer_id: str) -> str:
    """The peer's 64-bit position as a string of 0/1, the same for groups and shards."""
    digest = hashlib.blake2b(f"{run_id}\x00{peer_id}".encode(), digest_size=8).digest()
    return format(int.from_bytes(digest, "big"), "064b")


def group_key(prefix: str) -> str:
    return f"{GROUP_KEY_PREFIX}.0b{prefix}"


def key_prefix(key: str) -> str | None:
    """The bit prefix a group key names (`groups.0b0110` -> "0110"); None for anything else."""
    head = f"{GROUP_KEY_PREFIX}.0b"
    prefix = key[len(head) :] if isinstance(key, str) and key.startswith(head) else None
    if prefix is None or len(prefix) > 64 or prefix.strip("01"):
        return None
    return prefix


def member_check(run_id: str, key: str) -> Callable[[str], bool]:
    """Whether a peer id belongs to the group `key`: checkable from the peer id alone (its
    position starts with the key's prefix). Nobody belongs to a malformed key."""
    prefix = key_prefix(key)
    return lambda peer_id: prefix is not None and peer_bits(run_id, peer_id).startswith(prefix)


@dataclass(frozen=True)
class Grouping:
    """One epoch's groups: the decision every replica reaches from the same view."""

    epoch: int
    bits: int
    members: dict[str, tuple[str, ...]]
    """Group key -> its peers, sorted; only non-empty groups."""

    @property
    def num_learners(self) -> int:
        """The learner count that sizes the outer step: non-empty groups."""
        return len(self.members)

    def group_of(self, peer_id: str) -> str | None:
        for key, peers in self.members.items():
            if peer_id in peers:
                return key
        return None


class GroupingPolicy:
    """Decides an epoch's grouping from its membership view; holds no mutable state."""

    def __init__(self, run_id: str, config: GroupingConfig | None = None) -> None:
        self.run_id = run_id
        self.config = config or GroupingConfig()

    def bits_for(self, num_peers: int, previous_bits: int | None = None) -> int:
        """The group bits for ``num_peers``; from ``previous_bits`` it moves one step at a time
        past the hysteresis margins, or jumps straight to the target without one."""
        if num_peers < 0:
            raise ValueError(f"num_peers must be >= 0, got {num_peers}.")
        target = self._target_bits(num_peers)
        if previous_bits is None:
            return target
        bits = min(max(previous_bits, 0), self.config.max_bits)
        h = self.config.hysteresis
        while bits < target and num_peers >= self.peers_at(bits + 1) * (1 + h):
            bits += 1
        while bits > target and num_peers < self.peers_at(bits) * (1 - h):
            bits -= 1
        return bits

    def _target_bits(self, num_peers: int) -> int:
        bits = 0
        while bits < self.config.max_bits and num_peers >= self.peers_at(bits + 1):
            bits += 1
        return bits

    def group_floor(self, bits: int) -> int:
        """Fewest peers a group should hold on average at `bits`: `min_group_size`, and at
        least half as many as there are groups. A member of a completed round fetches its
        1/g slice of each of the other L - 1 groups' updates, about (L - 1)/g updates a
        round, so g below L/2 costs a member more than two updates' bytes where fewer
        learners would cost less (the simulator at 256 peers: 32 groups of 8, 20.8
        MB/node/round, against 16 groups of 16, 5.6; docs/scale.md, session 27)."""
        return max(self.config.min_group_size, 2 ** max(bits - 1, 0))

    def peers_at(self, bits: int) -> int:
        """The peers `bits` wants: 2**bits groups of `group_floor(bits)`."""
        return 2**bits * self.group_floor(bits)

    def prefix_of(self, peer_id: str, bits: int) -> str:
        return peer_bits(self.run_id, peer_id)[:bits]

    def key_of(self, peer_id: str, bits: int) -> str:
        """The peer's group key at ``bits``: checkable from its peer id alone."""
        return group_key(self.prefix_of(peer_id, bits))

    def decide(self, view: MembershipView, previous_bits: int | None = None) -> Grouping:
        return self.at_bits(view, self.bits_for(len(view.peers), previous_bits))

    def at_bits(self, view: MembershipView, bits: int) -> Grouping:
        """The view's groups at a split already agreed (dht.grouping_split): the peers by
        their first `bits` bits, each group under `MIN_MEMBERS` merged into its parent prefix
        (`merged_prefixes`). A function of the view's set and `bits` alone."""
        prefixes = merged_prefixes([self.prefix_of(p, bits) for p in view.peers], MIN_MEMBERS)
        members: dict[str, list[str]] = {}
        for peer in sorted(view.peers):
            position = peer_bits(self.run_id, peer)
            prefix = next(q for q in prefixes if position.startswith(q))
            members.setdefault(group_key(prefix), []).append(peer)
        ordered = {key: tuple(members[key]) for key in sorted(members)}
        return Grouping(view.epoch, bits, ordered)


def merged_prefixes(positions: Iterable[str], min_members: int) -> list[str]:
    """The group prefixes of peers at `positions` (each its prefix at the split, all one
    length): a prefix with fewer than `min_members` peers is replaced, with every prefix
    under its parent, by the parent, deepest (then smallest) first, until none is left but
    the root. Prefix-free and covering every position; the same for the same multiset of
    positions in any order."""
    counts: dict[str, int] = {}
    for position in positions:
        counts[position] = counts.get(position, 0) + 1
    while True:
        small = [q for q, n in counts.items() if q and n < min_members]
        if not small:
            return sorted(counts)
        parent = min(small, key=lambda q: (-len(q), q))[:-1]
        under = [q for q in counts if q.startswith(parent)]
        counts[parent] = sum(counts.pop(q) for q in under)
