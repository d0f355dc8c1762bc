"""Reduce-scatter inside a learner group: how the update is split, and who reduces what.

The flat update is split into one shard per member of the epoch's member list (sorted), on
the chunk grid (merge.group_chunks `aligned_bounds`: runs of whole chunks, the first
`chunks % M` shards one chunk longer; session 27, before it as `torch.tensor_split` cut
it), and a shard's digest is the root of its chunks' digests (`shard_digest`). The split is fixed
by the member list, not by who contributes in time: a sender's shard digests are the same
whichever members end up included, so its signed header (merge.group_update) can sign them
before the deadline (`shard_root`), and a reducer that holds only shard j of a part can check
it against its author's signature.

Shard j is reduced by member j when member j is included; the shard of a member not included
(a straggler, or one lost while reducing: then the round retries without it) goes to the
included member that ranks highest for it by rendezvous hashing (BLAKE2b of the shard and the
peer id): a pure function of (member list, included set), so every member and every replica
that verifies the update derives the same reducers, and losing one reducer moves only the
shards it held. Pure: no network, no clock, no torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from merge.group_chunks import aligned_bounds, shard_bounds

__all__ = [
    "ShardPlan",
    "aligned_bounds",
    "members_digest",
    "shard_bounds",
    "shard_root",
    "sharded_statement",
    "spread",
]

_ROOT_TAG = b"diloco-group-shard-root-v1\x00"
_SHARDED_TAG = b"diloco-group-sharded-v1\x00"
"""Unchanged in session 27, when the shard digest it names became a chunk root
(merge.group_chunks): proofs of equivocation made before still verify, the version is told
by the messages' magics (dht.grouping_shards, dht.shard_fetch_wire), and a chunk root (a
tagged hash of digests) never equals a session 26 digest (a hash of values)."""


def shard_root(digests: Sequence[str]) -> str:
    """What a member's header signs as its part's digest when it is sent by shards: the
    SHA-256 of its shards' digests in order (their count included)."""
    return hashlib.sha256(_ROOT_TAG + json.dumps(list(digests)).encode()).hexdigest()


def members_digest(members: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(members).encode()).hexdigest()


def sharded_statement(
    round_fields: tuple[str, str, int, int],
    included: Sequence[str],
    members: Sequence[str],
    shard: int,
    shard_digest: str,
) -> bytes:
    """What the reducer of `shard` co-signs: the round ((run id, group key, epoch, round)),
    who is included, the member list the split is fixed by, its shard and the reduced
    shard's digest."""
    run_id, group_key, epoch, round_ = round_fields
    signed = {
        "run_id": run_id,
        "group_key": group_key,
        "epoch": epoch,
        "round": round_,
        "included": list(included),
        "members": members_digest(members),
        "shards": len(members),
        "shard": shard,
        "shard_digest": shard_digest,
    }
    return _SHARDED_TAG + json.dumps(signed, sort_keys=True).encode()


def _rank(shard: int, peer: str) -> bytes:
    return hashlib.blake2b(f"{shard}\x00{peer}".encode(), digest_size=8).digest()


def _ranked(shard: int, peers: list[str]) -> str:
    """The peer ranking highest for `shard` (rendezvous hashing)."""
    return max(peers, key=lambda peer: _rank(shard, peer))


@dataclass(frozen=True)
class ShardPlan:
    """The split of one group round's update, fixed by the epoch's member list."""

    members: tuple[str, ...]
    """The epoch's member list, sorted, without repeats: shard j is first member j's."""

    def __post_init__(self) -> None:
        if not self.members or list(self.members) != sorted(set(self.members)):
            raise ValueError("a shard plan needs a sorted member list without repeats.")

    @classmethod
    def of(cls, members: Iterable[str]) -> ShardPlan:
        return cls(tuple(sorted(set(members))))

    @property
    def num_shards(self) -> int:
        return len(self.members)

    def bounds(self, numel: int) -> list[tuple[int, int]]:
        """[start, end) of each member's shard, on the chunk grid (`aligned_bounds`)."""
        return aligned_bounds(numel, self.num_shards)

    def reducers(self, included: Iterable[str]) -> tuple[str, ...]:
        """The reducer of each shard for this included set (a subset of the members, not
        empty): its own member if included, else the included member ranking highest."""
        inc = sorted(set(included))
        if not inc or not set(inc) <= set(self.members):
            raise ValueError("the included set must be a non-empty subset of the members.")
        taken = set(inc)
        return tuple(m if m in taken else _ranked(j, inc) for j, m in enumerate(self.members))

    def shards_of(self, member: str, included: Iterable[str]) -> tuple[int, ...]:
        """The shards `member` reduces for this included set (none if it is not included)."""
        return tuple(j for j, r in enumerate(self.reducers(included)) if r == member)

    def sends(self, author: str, included: Iterable[str] | None = None) -> list[tuple[int, str]]:
        """(shard, reducer) of each piece of `author`'s part that goes to another member:
        before the deadline (`included` None) to the shard's own member, after it to the
        reducer the included set names. The author keeps the shards it reduces itself."""
        reducers = self.members if included is None else self.reducers(included)
        return [(j, r) for j, r in enumerate(reducers) if r != author]


def spread(num_shards: int, peers: Iterable[str]) -> tuple[str, ...]:
    """Which of `peers` fetches each of an incoming update's `num_shards` shards (rendezvous
    hashing: a peer lost moves only the shards it held; every member derives the same)."""
    ranked = sorted(set(peers))
    if not ranked or num_shards < 0:
        raise ValueError("spreading shards needs at least one peer.")
    return tuple(_ranked(k, ranked) for k in range(num_shards))
