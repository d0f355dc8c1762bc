"""A member's part Gram matrix as the fetch round sends it since session 29 (docs/trust.md,
"A member's part in fp32"; docs/scale.md, Session 29: parts29). Pure.

Until session 28 a part travelled as float64 (its upper triangle) with one SHA-256 per
update of the round naming the variant the member fetched its slices of: (3 + K)(4 + K)/2 x
8 bytes and K x 32, all-gathered by every member (g - 1 parts received a round). Since
session 29:

- `wire_part`: the member's part rounded to float32 values *before* it is used anywhere:
  the member keeps the rounded matrix as its own part (merge.shard_member `MemberRound.part`),
  so its own copy and every receiver's are the same values bit for bit and every member sums
  the same parts (`summed_gram`). The rounding is directed so that a Gram matrix of real
  vectors stays one: each diagonal entry (a squared norm) rounds up, each off-diagonal entry
  (a dot product) rounds toward zero, so |G_ij| <= sqrt(G_ii G_jj) still holds wherever it
  held (`gram_problem` refuses no honest part). A part with an entry beyond float32's range
  cannot be sent: None (the round falls back to the whole fetch).
- `variants_digest`: one SHA-256 over the round's variant digests in id order; a receiver
  compares it with its own list's (`variant_differs` either way: no receiver used which id
  differed).

What each check reads, and why float32 moves none of them for an honest member
(merge.shard_round_checks; every bound below is relative to what it bounds): float32 keeps
2^-24 of each entry; `part_problem` allows `STATE_SLACK` (1e-5) on the state entries;
`sums_problem` allows `SUMS_SLACK` (1e-5) of a sum's reach, and a combo's norm or its dot
with a state moves by at most 2^-24 of the reach (each entry by 2^-24 of itself, and each
|G_ij| <= sqrt(G_ii G_jj)); the decision reads the summed matrix, whose entries move by
2^-24 of the parts' magnitudes: a verdict at a threshold's edge, as the parts' float64 sums
could already (the round's own sums travel in float32 since session 24).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import numpy as np

from merge.shard_round_plan import Gram

VARIANTS_DOMAIN = b"diloco-fetch-variants/1\n"
"""Tags the SHA-256 of a round's variant list (`variants_digest`)."""


def wire_part(part: Sequence[Sequence[float]]) -> Gram | None:
    """`part` (a float64 Gram matrix, exactly symmetric) rounded to float32 values, directed
    so that Cauchy-Schwarz and non-negative norms still hold: the diagonal up, the rest
    toward zero. None when an entry is not finite or beyond float32's range."""
    exact = np.array(part, dtype=np.float64).reshape(len(part), len(part))
    if not np.isfinite(exact).all() or np.abs(exact).max(initial=0.0) > np.finfo(np.float32).max:
        return None
    near = exact.astype(np.float32)
    wide = near.astype(np.float64)
    toward_zero = np.where(np.abs(wide) > np.abs(exact), np.nextafter(near, np.float32(0.0)), near)
    diagonal = np.diag(exact)
    up = np.diag(near)
    up = np.where(up.astype(np.float64) < diagonal, np.nextafter(up, np.float32(np.inf)), up)
    rounded = toward_zero.copy()
    np.fill_diagonal(rounded, up)
    if not np.isfinite(rounded).all():
        return None
    return mirrored(upper_triangle(rounded.astype(np.float64).tolist()), len(part))


def upper_triangle(part: Sequence[Sequence[float]]) -> list[float]:
    """The upper triangle of `part`, row by row (what a `part` message carries)."""
    size = len(part)
    return [part[i][j] for i in range(size) for j in range(i, size)]


def triangle_side(length: int) -> int | None:
    """The side of a square whose upper triangle has `length` entries, or None."""
    side = (math.isqrt(8 * length + 1) - 1) // 2
    return side if side * (side + 1) // 2 == length and side > 0 else None


def mirrored(upper: Sequence[float], size: int) -> Gram:
    """The symmetric matrix whose upper triangle (row by row) is `upper`."""
    gram = [[0.0] * size for _ in range(size)]
    at = 0
    for i in range(size):
        for j in range(i, size):
            gram[i][j] = gram[j][i] = float(upper[at])
            at += 1
    return gram


def variants_digest(variants: Sequence[str]) -> str:
    """The SHA-256 (hex) of a round's variant digests in id order (each 64 hex digits)."""
    hasher = hashlib.sha256(VARIANTS_DOMAIN)
    hasher.update(len(variants).to_bytes(4, "big"))
    for variant in variants:
        hasher.update(variant.encode("ascii"))
    return hasher.hexdigest()
