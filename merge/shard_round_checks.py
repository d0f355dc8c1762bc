"""The checks a member runs on the round's Gram matrix and on another member's slices of the
round's sums (merge.shard_round; docs/scale.md, Session 16: trust)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from merge.shard_round_plan import Gram, Incoming, RoundPlan

_SCHWARZ_SLACK = 1e-9
SUMS_SLACK = 1e-5
"""A member's slices of a sum may be off what its part says by this share of the sum's
reach: float32 rounding of the sum. (Session 20 sent the sums in bf16 and widened this by
2^-8, letting a member lean its slice by up to 0.4 %; session 24 sends them in fp32 again,
merge.shard_member `sums`.)"""


def gram_problem(gram: object, size: int) -> str | None:
    """Why `gram` cannot be the Gram matrix of `size` real vectors (a member's part, or their
    sum), or None: square of `size`, finite, symmetric, a non-negative diagonal, and each dot
    product within Cauchy-Schwarz. A member cannot claim a cross term its vectors' norms do
    not allow."""
    if not isinstance(gram, list) or len(gram) != size:
        return "gram_shape"
    if not all(isinstance(row, list) and len(row) == size for row in gram):
        return "gram_shape"
    if not all(type(x) is float and math.isfinite(x) for row in gram for x in row):
        return "gram_not_finite"
    if any(gram[i][i] < 0 for i in range(size)):
        return "gram_negative_norm"
    for i in range(size):
        for j in range(i + 1, size):
            if gram[i][j] != gram[j][i]:
                return "gram_asymmetric"
            if abs(gram[i][j]) > math.sqrt(gram[i][i] * gram[j][j]) * (1 + _SCHWARZ_SLACK):
                return "gram_beyond_schwarz"
    return None


def round_problem(incoming: Sequence[Incoming], gram: object, num_states: int) -> str | None:
    """Why the round's Gram matrix (`summed_gram` of the members' parts, `incoming` in id
    order) cannot be decided on, or None: not a Gram matrix (`gram_problem`), or claiming an
    update (not refused by its headers) longer than its signed headers allow
    (`signed_norm_bound`): a member inflating its part of an update's norm cannot make its
    group's robust judge clip it beyond what its members signed. (The norm cap reads the
    signed bound alone, not the matrix: no part moves a refusal.)"""
    problem = gram_problem(gram, num_states + len(incoming))
    if problem is not None:
        return problem
    assert isinstance(gram, list)
    for i, inc in enumerate(incoming):
        index = num_states + i
        if inc.problem is None and gram[index][index] > inc.norm_bound**2:
            return "gram_beyond_signed_norm"
    return None


def sums_problem(
    plan: RoundPlan, part: Gram, sums: Sequence[torch.Tensor], states: Sequence[torch.Tensor]
) -> str | None:
    """Why a member's gathered slices `sums` do not match the part Gram matrix `part` it sent
    (checked before the decisions were taken, `gram_problem`), or None; `states`: the
    receiver's own slices of its state tensors over that member's part. Each slice's norm and
    its dot product with each state tensor's slice must be what `part` says of that combo of
    the member's shards (within `SUMS_SLACK` of the sum's reach: float32 rounding of the sum):
    a member cannot send a slice larger than, or leaning along the momentum or the params
    more than, the shards it reported; what is left to it is the direction orthogonal to the
    receiver's state, within the reported norm (docs/scale.md, Session 16: trust)."""
    num_states = len(states)
    gram = np.array(part)
    if len(sums) != len(plan.combos) or gram.shape != (num_states + plan.size,) * 2:
        return "sums_shape"
    for combo, total in zip(plan.combos, sums, strict=True):
        c = np.array(combo)
        if total.numel() != states[0].numel() or not bool(torch.isfinite(total).all()):
            return "sums_shape"
        block = gram[num_states:, num_states:]
        reach = float(np.abs(c) @ np.sqrt(np.diag(block))) + 1e-30
        slack = SUMS_SLACK * reach
        total64 = total.to(torch.float64)
        if abs(float(total64 @ total64) - float(c @ block @ c)) > slack * (2 * reach + slack):
            return "sums_norm"
        for i, state in enumerate(states):
            expected = float(c @ gram[num_states:, i])
            bound = slack * math.sqrt(max(gram[i][i], 0.0))
            if abs(float(total64 @ state.to(torch.float64)) - expected) > bound + 1e-30:
                return "sums_direction"
    return None
