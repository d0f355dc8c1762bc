"""Who holds each shard of a group update, what a holder of some shards serves, and a whole
update assembled from its shards' holders (issue 22, must-have 2: the own update folded into
the fetch round; docs/scale.md, Session 28). Pure: no network.

Folded (levers27's `--fold-own`), nobody holds a group update whole after its round: each
reducer holds the shard it reduced and, with `replicas` 2, the next included member holds it
too (the reducer sends it inside the round). Who holds shard k is a pure function of the
update's co-signed fields (its member list, its included authors, the chunk grid:
`GroupUpdate.reducers`), so an asker that has the fields derives it: no notice carries it.

- `shard_holders`: shard k's reducer, then the next included members in sorted order.
- `ShardHolding`: the shards a holder has of one update (its fields, each shard's values),
  what it answers `group-slice` asks from (dht.shard_fetch_slices); a whole update is the
  holding of every shard (`of_whole`).
- `ShardAssembly`: a whole update put together shard by shard, each piece checked against
  its reducer's co-signed chunk root before it is kept (`GroupUpdate.slice_problem`); whole
  once every shard is in, and then checked as any whole update is (`GroupUpdate.problem`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

from merge.group_chunks import chunk_digests
from merge.group_update import GroupUpdate
from merge.shard_fetch import wanted_pieces

SHARD_REPLICAS = 2
"""Holders of each shard after a folded round: its reducer and the next included member
(levers27: r = 1 left 135 of ~N slice asks a round without a live holder at 1000 peers with
1 % churn, r = 2 left 8, for +0.03 MB/node/round)."""


def shard_holders(
    update: GroupUpdate, shard: int, replicas: int = SHARD_REPLICAS
) -> tuple[str, ...]:
    """Who holds shard `shard` of `update` (its fields suffice): its reducer, then the
    included members after it in sorted order (cyclic), `replicas` in all (at most every
    included member)."""
    if replicas < 1:
        raise ValueError("a shard has at least one holder (its reducer).")
    if not 0 <= shard < update.num_shards:
        raise ValueError(f"shard {shard} of an update of {update.num_shards} shards.")
    included = sorted(h.author for h in update.contributions)
    at = included.index(update.reducers()[shard])
    return tuple(included[(at + j) % len(included)] for j in range(min(replicas, len(included))))


def held_shards(update: GroupUpdate, peer: str, replicas: int = SHARD_REPLICAS) -> tuple[int, ...]:
    """The shards `peer` holds of `update` after a folded round (none when not included)."""
    return tuple(k for k in range(update.num_shards) if peer in shard_holders(update, k, replicas))


def folded(update: GroupUpdate, numel: int) -> bool:
    """Whether `update` is a folded round's fields alone (no aggregate: applied by the
    members' fetch round, never at once), for a model of `numel` values."""
    return numel > 0 and update.aggregate.numel() == 0


def fields_of(update: GroupUpdate) -> GroupUpdate:
    """The update's fields alone (headers, digests, co-signatures; an empty aggregate)."""
    return replace(update, aggregate=torch.zeros(0))


@dataclass(frozen=True)
class ShardHolding:
    """Some shards of one update and its fields: what a holder serves slices from."""

    fields: GroupUpdate
    """The update's co-signed fields (its aggregate empty)."""
    numel: int
    shards: Mapping[int, torch.Tensor]
    """Shard index -> its values, exactly as its reducer co-signed them."""

    @classmethod
    def of_whole(cls, update: GroupUpdate) -> ShardHolding:
        numel = update.aggregate.numel()
        bounds = update.shard_bounds(numel)
        shards = {k: update.aggregate[a:b] for k, (a, b) in enumerate(bounds)}
        return cls(fields_of(update), numel, shards)

    @classmethod
    def of_shards(
        cls, update: GroupUpdate, numel: int, shards: Mapping[int, torch.Tensor]
    ) -> ShardHolding:
        """The holding of `shards` of `update` (its aggregate may be empty) of a model of
        `numel` values, each checked against its reducer's co-signed digest (ValueError: a
        caller's bug, never a peer's: a holder keeps only shards it checked)."""
        for k, tensor in shards.items():
            if not 0 <= k < update.num_shards:
                raise ValueError(f"shard {k} of an update of {update.num_shards} shards.")
            problem = update.shard_problem(k, tensor, numel)
            if problem is not None:
                raise ValueError(f"shard {k} is not what its reducer co-signed: {problem}")
        return cls(fields_of(update), numel, dict(shards))

    def covers(self, start: int, end: int) -> bool:
        """Whether every shard [start, end) meets is held here."""
        wanted = wanted_pieces(self.fields.num_shards, self.numel, start, end)
        return all(k in self.shards for k, _, _ in wanted)

    def pieces(self, start: int, end: int) -> list[tuple[int, torch.Tensor, tuple[str, ...]]]:
        """(shard, what [start, end) holds of it, the shard's chunk digests), in shard order;
        ValueError when a shard the range meets is not held (ask `covers` first)."""
        bounds = self.fields.shard_bounds(self.numel)
        out = []
        for k, a, b in wanted_pieces(self.fields.num_shards, self.numel, start, end):
            if k not in self.shards:
                raise ValueError(f"shard {k} is not held here.")
            lo = bounds[k][0]
            shard = self.shards[k]
            out.append((k, shard[a - lo : b - lo], chunk_digests(shard, self.numel, lo)))
        return out


class ShardAssembly:
    """A whole update put together from its shards' holders (see the module's docstring)."""

    def __init__(self, fields: GroupUpdate, numel: int) -> None:
        """`fields`: the update's fields, their headers checked (`header_problem`)."""
        self.fields = fields_of(fields)
        self.numel = numel
        self.bounds = fields.shard_bounds(numel)
        self._shards: dict[int, torch.Tensor] = {}

    def missing(self) -> list[int]:
        return [k for k in range(self.fields.num_shards) if k not in self._shards]

    def take(self, shard: int, digests: tuple[str, ...], piece: torch.Tensor) -> str | None:
        """Shard `shard` whole, as a holder served it (its chunk digests, its values): kept
        when it is what its reducer co-signed; else the refusal (counted by the caller)."""
        if not 0 <= shard < self.fields.num_shards:
            return "shard_index"
        lo, hi = self.bounds[shard]
        if piece.dtype != torch.float32 or piece.shape != (hi - lo,):
            return "shard_size"
        problem = self.fields.slice_problem(shard, digests, lo, piece, self.numel)
        if problem is None:
            self._shards[shard] = piece
        return problem

    def whole(self, in_group: Callable[[str], bool]) -> GroupUpdate | str:
        """The whole update once every shard is in and it passes every check a whole update
        passes (`GroupUpdate.problem`), else why not ("shards_missing" while some are)."""
        if self.missing():
            return "shards_missing"
        aggregate = torch.cat([self._shards[k] for k in range(self.fields.num_shards)])
        update = replace(self.fields, aggregate=aggregate)
        return update.problem(in_group) or update
