"""Which heartbeat shard one node reads and writes: the DHT-side walk of dht.shards' tree.

dht.shards.ShardTree is the tree as a whole; no node holds it. In a running swarm each
node keeps only its own place in it (a `ShardCursor`): the depth of the leaf its peer-id
position falls in. The DHT holds, at each shard key, the heartbeats of that leaf's peers and,
at a key that has split, *split marks*: small records under their writers' owner subkeys
(``[owner:PEER]/split``) that send readers one level down.

Per read of one key the cursor decides one step (`ShardCursor.step`):

- the key holds a mark from a peer whose position lies under it: it has split, go down;
- it holds more than ``max_records`` heartbeats: split it (write a mark there), go down;
- it is sparse (it and its sibling together under ``merge_below`` x ``max_records``): stop
  refreshing the parent's mark; once no live mark is left at the parent (marks expire after
  three heartbeat periods), go up;
- otherwise it is this node's leaf: stay.

Marks are refreshed by a few of the peers below them, not all (`marks_to_refresh`): each
refreshes an ancestor with probability ``MARK_WRITERS`` / (peers estimated under it), so a
mark key holds a handful of records at any swarm size, and whatever a key holds stays
bounded by about ``max_records`` heartbeats plus those marks.

A mark counts only from a peer whose own position lies under the marked prefix (checkable
from its id); a crafted mark can still force a split, bounded by ``max_depth``.

Pure: records in, decisions out. dht.membership does the reading and writing.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from dht.grouping import peer_bits
from dht.records import owner_subkey, subkey_owner
from dht.shards import ShardConfig, shard_key

SPLIT_SUFFIX = "/split"
SPLIT_VALUE = b"split"
MARK_WRITERS = 4.0
"""Peers expected to refresh one split mark per heartbeat period (a mark lives 3 periods:
the chance that none refreshes it in time is about e**-12)."""


def split_subkey(peer_id: str) -> str:
    return owner_subkey(peer_id, SPLIT_SUFFIX)


class Step(enum.Enum):
    STAY = "stay"
    DOWN = "down"
    """The key has split: read the child on this node's side."""
    SPLIT = "split"
    """The key overflows: mark it split (this node writes the mark), then go down."""
    UP = "up"
    """The key and its sibling are sparse and the parent is no longer marked: go up."""


@dataclass(frozen=True)
class ShardRead:
    """What one shard key held, sorted by kind; records of no known kind are `junk`."""

    prefix: str
    heartbeats: dict[str, object]
    """Owner peer id -> heartbeat blob, for owners whose position lies under `prefix`."""
    marks: int
    """Split marks from peers under `prefix`."""
    junk: dict[object, object]
    """Subkey -> value of every other record (foreign positions, unknown subkeys)."""

    @property
    def is_leaf(self) -> bool:
        """A leaf holding at least one heartbeat: reading it proves who is absent under it."""
        return self.marks == 0 and bool(self.heartbeats)


def parse_shard(run_id: str, prefix: str, records: Mapping[object, object]) -> ShardRead:
    """Sorts the records of shard key `prefix` (untrusted: anything may be there)."""
    heartbeats: dict[str, object] = {}
    junk: dict[object, object] = {}
    marks = 0
    for subkey, value in records.items():
        owner = subkey_owner(subkey)
        if owner is None or not peer_bits(run_id, owner).startswith(prefix):
            junk[subkey] = value
        elif subkey == owner_subkey(owner):
            heartbeats[owner] = value
        elif subkey == split_subkey(owner) and value == SPLIT_VALUE:
            marks += 1
        else:
            junk[subkey] = value
    return ShardRead(prefix, heartbeats, marks, junk)


class ShardCursor:
    """This node's leaf in the heartbeat shard tree, moved one step per key read."""

    def __init__(self, run_id: str, peer_id: str, config: ShardConfig | None = None) -> None:
        self.run_id = run_id
        self.config = config or ShardConfig()
        self.position = peer_bits(run_id, peer_id)
        self.depth = 0
        self.leaf_count = 1
        """Heartbeats last found in this node's leaf (itself included)."""

    @property
    def prefix(self) -> str:
        return self.position[: self.depth]

    @property
    def key(self) -> str:
        return shard_key(self.prefix)

    @property
    def sibling(self) -> str | None:
        """The sibling of this node's leaf (None at the root)."""
        if not self.depth:
            return None
        return self.prefix[:-1] + ("1" if self.prefix[-1] == "0" else "0")

    def is_sparse(self, leaf_count: int) -> bool:
        """Whether this leaf is small enough that it may merge with its sibling."""
        return self.depth > 0 and leaf_count < self.merge_limit

    @property
    def merge_limit(self) -> float:
        return self.config.merge_below * self.config.max_records

    def step(
        self, read: ShardRead, *, sibling: ShardRead | None = None, parent: ShardRead | None = None
    ) -> Step:
        """One step after reading this node's key (`read`); `sibling` and `parent` are read
        only when `wants_sibling` / `wants_parent` said so."""
        assert read.prefix == self.prefix, (read.prefix, self.prefix)
        deepest = self.depth >= self.config.max_depth
        if read.marks and not deepest:
            self.depth += 1
            return Step.DOWN
        if len(read.heartbeats) > self.config.max_records and not deepest:
            self.depth += 1
            return Step.SPLIT
        self.leaf_count = max(1, len(read.heartbeats))
        if (
            sibling is not None
            and parent is not None
            and self.merges_with(read, sibling)
            and parent.marks == 0
        ):
            self.depth -= 1
            return Step.UP
        return Step.STAY

    def wants_sibling(self, read: ShardRead) -> bool:
        """Whether the sibling must be read to decide a merge (only when this leaf is sparse)."""
        return not read.marks and self.is_sparse(len(read.heartbeats))

    def merges_with(self, read: ShardRead, sibling: ShardRead) -> bool:
        """This leaf and its sibling (itself a leaf or empty) hold few enough to merge."""
        if sibling.marks:
            return False
        return len(read.heartbeats) + len(sibling.heartbeats) < self.merge_limit

    def marks_to_refresh(self, rng: random.Random, *, merging: bool) -> list[str]:
        """Ancestors (prefixes) whose split mark this node refreshes this period. A node whose
        leaf is about to merge does not refresh its parent's mark, so that mark expires."""
        chosen = []
        for depth in range(self.depth):
            if merging and depth == self.depth - 1:
                continue
            below = self.leaf_count * 2 ** (self.depth - depth)
            if rng.random() < min(1.0, MARK_WRITERS / below):
                chosen.append(self.position[:depth])
        return chosen


def adjust_sample(
    read: ShardRead, position: str, max_depth: int, empty: set[str] | None = None
) -> str | None:
    """The next key to read for a sampled position after reading `read`: one level down if
    it has split, one level up if it is empty (merged away, or a sparse corner of an uneven
    tree), None if it was a leaf. `empty` (the walk's memory, updated here) keeps a walk that
    went up from an empty key from going back down into it: it takes the sibling instead."""
    empty = set() if empty is None else empty
    prefix = read.prefix
    if read.marks and len(prefix) < max_depth:
        child = position[: len(prefix) + 1]
        if child in empty:
            child = prefix + ("1" if child[-1] == "0" else "0")
        return None if child in empty else child
    if not read.heartbeats and prefix:
        empty.add(prefix)
        return prefix[:-1]
    return None


def covered(peer_position: str, leaves: Iterable[str]) -> bool:
    """Whether one of the leaves read holds the peer's position (its absence there is proof)."""
    return any(peer_position.startswith(leaf) for leaf in leaves)


@dataclass(frozen=True)
class TreeWalk:
    """Every shard key a walk of (a subtree of) the tree read (`TreeWalker`)."""

    records: list[tuple[object, object]]
    """(subkey, value) of each heartbeat and junk record found, in the order read."""
    leaves: dict[str, int]
    """Key prefix -> heartbeats of peers under it found there, for each key holding any: the
    shard directory as read (a split key keeps some while its peers move down)."""
    complete: list[str]
    """Prefixes of the leaves read (no mark): a peer under one of them that is not in
    `records` is absent (as `ShardPoll.leaves`)."""
    truncated: bool
    """The walk stopped at `max_keys` with keys left unread."""


class TreeWalker:
    """Walks the shard tree below `root`: each key with a split mark sends the walk to both
    children, at most `max_keys` keys. The caller reads the keys (`next_key`, then `take`),
    so one walk serves a blocking reader (`walk_tree`) and an async one alike.

    From the root it is the whole swarm (`status`, the dashboard: N / max_records keys, paid
    by the observer, never by a training node); from a learner group's prefix it is that
    group (about g / max_records keys, docs/scale.md)."""

    def __init__(self, run_id: str, *, root: str = "", max_keys: int, max_depth: int) -> None:
        self.run_id = run_id
        self.max_keys = max_keys
        self.max_depth = max_depth
        self._pending = [root]
        self._visited = 0
        self._records: list[tuple[object, object]] = []
        self._leaves: dict[str, int] = {}
        self._complete: list[str] = []

    def next_key(self) -> str | None:
        """The prefix of the next key to read; None when the walk is done."""
        if not self._pending or self._visited >= self.max_keys:
            return None
        return self._pending[-1]

    def take(self, prefix: str, records: Mapping[object, object]) -> ShardRead:
        """What the key `next_key()` named held (untrusted records)."""
        assert self._pending and self._pending[-1] == prefix, (prefix, self._pending)
        self._pending.pop()
        self._visited += 1
        read = parse_shard(self.run_id, prefix, records)
        self._records.extend((owner_subkey(p), blob) for p, blob in read.heartbeats.items())
        self._records.extend(read.junk.items())
        if read.marks and len(prefix) < self.max_depth:
            self._pending.extend((prefix + "1", prefix + "0"))
        else:
            self._complete.append(prefix)
        if read.heartbeats:
            self._leaves[prefix] = len(read.heartbeats)
        return read

    def result(self) -> TreeWalk:
        return TreeWalk(
            self._records,
            dict(sorted(self._leaves.items())),
            sorted(self._complete),
            bool(self._pending),
        )


def walk_tree(
    run_id: str,
    read_key: Callable[[str], Mapping[object, object]],
    *,
    root: str = "",
    max_keys: int,
    max_depth: int,
) -> TreeWalk:
    """A `TreeWalker` walk with a blocking reader: `read_key(prefix)` reads one shard key."""
    walker = TreeWalker(run_id, root=root, max_keys=max_keys, max_depth=max_depth)
    while (prefix := walker.next_key()) is not None:
        walker.take(prefix, read_key(prefix))
    return walker.result()
