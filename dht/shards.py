"""Sharded heartbeat keys: membership without one hot DHT key.

Heartbeats live under ``heartbeats.0bPREFIX``, the prefix taken from the same peer-id hash
as the learner groups (dht.grouping.peer_bits). The leaves of a binary prefix tree hold the
heartbeats; a leaf holding more than ``max_records`` splits into its two children, leaving a
split marker (one record) at its key that sends readers down; two sibling leaves that
together hold fewer than ``merge_below`` x ``max_records`` merge back into their parent. This
is hivemind's averaging key manager's idea (a bucket that fills gains a bit) applied to
membership, with the merge it lacks. The thresholds differ (hysteresis), so a leaf that has
just split does not merge again at once.

Pure: the tree is what the DHT's keys would hold; the network layer stores and reads it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dht.grouping import peer_bits

SHARD_KEY_PREFIX = "heartbeats"
_POSITION_BITS = 64


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """Sizes of the heartbeat shards; part of the run's settings."""

    max_records: int = 32
    """Most heartbeats one key holds before it splits."""
    merge_below: float = 0.25
    """Siblings merge when together they hold fewer than this share of max_records."""
    max_depth: int = 24
    """Deepest prefix; a leaf this deep holds whatever falls into it (2**-24 of the swarm)."""

    def __post_init__(self) -> None:
        if type(self.max_records) is not int or self.max_records < 2:
            raise ValueError(f"max_records must be an integer >= 2, got {self.max_records!r}.")
        if not isinstance(self.merge_below, int | float) or not 0 <= self.merge_below <= 0.5:
            raise ValueError(f"merge_below must be in [0, 0.5], got {self.merge_below!r}.")
        if type(self.max_depth) is not int or not 0 <= self.max_depth <= _POSITION_BITS:
            raise ValueError(f"max_depth must be an integer in [0, 64], got {self.max_depth!r}.")


def shard_key(prefix: str) -> str:
    return f"{SHARD_KEY_PREFIX}.0b{prefix}"


class ShardTree:
    """The heartbeat shards: which key holds whose heartbeat, and how readers find it."""

    def __init__(self, run_id: str, config: ShardConfig | None = None) -> None:
        self.run_id = run_id
        self.config = config or ShardConfig()
        self._leaves: dict[str, set[str]] = {"": set()}
        self._positions: dict[str, str] = {}

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._positions

    def __len__(self) -> int:
        return len(self._positions)

    def leaves(self) -> dict[str, int]:
        """Leaf prefix -> heartbeats it holds: the shard directory."""
        return {prefix: len(peers) for prefix, peers in sorted(self._leaves.items())}

    def peers_in(self, prefix: str) -> frozenset[str]:
        return frozenset(self._leaves[prefix])

    def leaf_of(self, peer_id: str) -> str:
        """The leaf a peer's heartbeat goes to (it need not be in the tree yet)."""
        position = self._position(peer_id)
        for depth in range(len(position) + 1):
            if position[:depth] in self._leaves:
                return position[:depth]
        raise AssertionError("the leaves cover every position")  # pragma: no cover

    def add(self, peer_id: str) -> str:
        """Records a heartbeat; returns the leaf it lands in after any split."""
        if peer_id not in self._positions:
            self._positions[peer_id] = peer_bits(self.run_id, peer_id)
        leaf = self.leaf_of(peer_id)
        self._leaves[leaf].add(peer_id)
        self._split(leaf)
        return self.leaf_of(peer_id)

    def remove(self, peer_id: str) -> None:
        """Forgets a heartbeat (expired or left); merges siblings that have become sparse."""
        if peer_id not in self._positions:
            return
        leaf = self.leaf_of(peer_id)
        self._leaves[leaf].discard(peer_id)
        del self._positions[peer_id]
        self._merge(leaf)

    def read_path(self, peer_id: str) -> list[str]:
        """The keys a reader with no cached directory visits to find a peer's heartbeat: each
        split marker on the way from the root, then the leaf."""
        leaf = self.leaf_of(peer_id)
        return [shard_key(leaf[:depth]) for depth in range(len(leaf) + 1)]

    def covering(self, prefix: str) -> list[str]:
        """The leaves holding every peer whose position starts with ``prefix`` (a group's
        members): one leaf above it, or the leaves below it."""
        above = [prefix[:d] for d in range(len(prefix) + 1) if prefix[:d] in self._leaves]
        if above:
            return above
        return sorted(leaf for leaf in self._leaves if leaf.startswith(prefix))

    def sample(self, rng: random.Random, count: int) -> list[str]:
        """A bounded random sample of leaves: the swarm-wide view one period reads."""
        leaves = sorted(self._leaves)
        return rng.sample(leaves, min(count, len(leaves)))

    def _position(self, peer_id: str) -> str:
        return self._positions.get(peer_id) or peer_bits(self.run_id, peer_id)

    def _split(self, leaf: str) -> None:
        pending = [leaf]
        while pending:
            prefix = pending.pop()
            peers = self._leaves[prefix]
            if len(peers) <= self.config.max_records or len(prefix) >= self.config.max_depth:
                continue
            del self._leaves[prefix]
            for bit in "01":
                child = prefix + bit
                self._leaves[child] = {p for p in peers if self._positions[p][len(prefix)] == bit}
                pending.append(child)

    def _merge(self, leaf: str) -> None:
        limit = self.config.merge_below * self.config.max_records
        while leaf:
            sibling = leaf[:-1] + ("1" if leaf[-1] == "0" else "0")
            if sibling not in self._leaves:
                return  # the sibling is split further: nothing to merge with
            if len(self._leaves[leaf]) + len(self._leaves[sibling]) >= limit:
                return
            parent = leaf[:-1]
            self._leaves[parent] = self._leaves.pop(leaf) | self._leaves.pop(sibling)
            leaf = parent
