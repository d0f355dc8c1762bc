"""Compact proofs for a group round's messages (session 28, digest28). Pure: no network, no torch.

- A part's shard digests under a Merkle root (`merkle_root`): what a member's header signs as
  its part's digest when it is sent by shards (merge.group_shards.sharded_contribution), so a
  `group-piece` carries its own shard's digest and the sibling hashes up to the root
  (`merkle_path`: ceil(log2 g) at most) instead of all g digests, and the receiver checks the
  shard's digest against the author's signed header with `proven_root` before reducing it.
  Leaves and inner nodes are hashed with different prefixes, an unpaired node is promoted
  unchanged, and the root binds the leaf count: one root names one list of digests.
- A co-signer set as a bitmap over the round's sorted member list (`bitmap_of`, `members_of`):
  g / 8 bytes, not ~55 bytes per peer id. One set has exactly one bitmap (length ceil(g / 8),
  the bits past g zero), and it decodes to the set in the member list's order, which is the
  order the reducer's co-signed statement lists it in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

_TAG = b"diloco-group-shard-merkle-v1\x00"
_LEAF, _NODE, _ROOT = b"\x00", b"\x01", b"\x02"
DIGEST_HEX = 64


class ProofError(ValueError):
    """An untrusted proof or bitmap that does not decode (its caller counts it)."""


def _raw(digest: str) -> bytes:
    if not isinstance(digest, str) or len(digest) != DIGEST_HEX:
        raise ProofError("a digest is 64 hex characters.")
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        raise ProofError("a digest is 64 hex characters.") from None
    if raw.hex() != digest:
        raise ProofError("a digest is in lower-case hex (one spelling per digest).")
    return raw


def _leaf(digest: str) -> bytes:
    return hashlib.sha256(_TAG + _LEAF + _raw(digest)).digest()


def _node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(_TAG + _NODE + left + right).digest()


def _root(count: int, top: bytes) -> str:
    return hashlib.sha256(_TAG + _ROOT + count.to_bytes(4, "big") + top).hexdigest()


def _levels(digests: Sequence[str]) -> list[list[bytes]]:
    level = [_leaf(d) for d in digests]
    levels = [level]
    while len(level) > 1:
        pairs = [_node(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        level = pairs + ([level[-1]] if len(level) % 2 else [])
        levels.append(level)
    return levels


def merkle_root(digests: Sequence[str]) -> str:
    """The root a sharded part's header signs over its shard digests in order (count bound)."""
    if not digests:
        raise ValueError("a part has at least one shard.")
    return _root(len(digests), _levels(digests)[-1][0])


def merkle_path(digests: Sequence[str], index: int) -> tuple[str, ...]:
    """The sibling hashes (hex) from leaf `index` up to the top, unpaired levels skipped."""
    if not 0 <= index < len(digests):
        raise ValueError(f"shard {index} of {len(digests)}.")
    path = []
    for level in _levels(digests)[:-1]:
        if index ^ 1 < len(level):
            path.append(level[index ^ 1].hex())
        index //= 2
    return tuple(path)


def path_length(index: int, count: int) -> int:
    """How many siblings leaf `index` of `count` has on its way up (0 <= index < count)."""
    length = 0
    while count > 1:
        length += index ^ 1 < count
        index, count = index // 2, (count + 1) // 2
    return length


def proven_root(digest: str, index: int, count: int, path: Sequence[str]) -> str:
    """The root that `digest` at leaf `index` of `count` and `path` lead to; ProofError when
    the index, the count or the path's length or hashes cannot be one (untrusted input)."""
    if type(index) is not int or type(count) is not int or not 0 <= index < count:
        raise ProofError("a shard index out of range.")
    if not isinstance(path, (list, tuple)) or len(path) != path_length(index, count):
        raise ProofError("a proof of the wrong length.")
    node, n = _leaf(digest), count
    siblings = iter(path)
    while n > 1:
        if index ^ 1 < n:
            sibling = _raw(next(siblings))
            node = _node(sibling, node) if index % 2 else _node(node, sibling)
        index, n = index // 2, (n + 1) // 2
    return _root(count, node)


def bitmap_of(subset: Sequence[str], members: Sequence[str]) -> str:
    """The hex bitmap of `subset` over `members` (sorted): bit i (most significant first in
    byte i // 8) set when members[i] is in the subset."""
    chosen = set(subset)
    if not chosen <= set(members):
        raise ValueError("a co-signer set names a peer outside the member list.")
    bits = bytearray((len(members) + 7) // 8)
    for i, member in enumerate(members):
        if member in chosen:
            bits[i // 8] |= 0x80 >> (i % 8)
    return bits.hex()


def members_of(bitmap: object, members: Sequence[str]) -> tuple[str, ...]:
    """The subset an untrusted bitmap names, in the member list's order; ProofError unless it
    is the one canonical bitmap of a non-empty subset (right length, no bits past the list)."""
    if not isinstance(bitmap, str) or len(bitmap) != 2 * ((len(members) + 7) // 8):
        raise ProofError("a co-signer bitmap of the wrong length.")
    try:
        bits = bytes.fromhex(bitmap)
    except ValueError:
        raise ProofError("a co-signer bitmap that is not hex.") from None
    if bitmap != bits.hex():
        raise ProofError("a co-signer bitmap not in lower-case hex.")
    chosen = tuple(m for i, m in enumerate(members) if bits[i // 8] & (0x80 >> (i % 8)))
    if bitmap_of(chosen, members) != bitmap or not chosen:
        raise ProofError("a co-signer bitmap with bits past the member list, or none set.")
    return chosen


@dataclass(frozen=True)
class ShardProof:
    """One shard's digest of a part and its path to the part's signed root."""

    shard: int
    count: int
    digest: str
    path: tuple[str, ...]

    @classmethod
    def of(cls, digests: Sequence[str], shard: int) -> ShardProof:
        return cls(shard, len(digests), digests[shard], merkle_path(digests, shard))

    def root(self) -> str:
        """The root it proves (ProofError when it cannot be one)."""
        return proven_root(self.digest, self.shard, self.count, self.path)
