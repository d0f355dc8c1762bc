"""Direction-aware correction of stale pseudo-gradients against the outer momentum.

After HeLoCo (Al Asif et al., arXiv 2606.00271): the outer momentum is the replica's best
estimate of where training is heading; a stale pseudo-gradient was computed from an older
model and parts of it may point against that heading. The flat pseudo-gradient is cut into
fixed blocks of ``block`` elements; in each block b with cosine c_b = <g_b, m_b>/(|g_b||m_b|)
between the update g and the momentum m:

- aligned (c_b >= 0): the block passes unchanged;
- conflicting (c_b < 0): the component along the momentum is shrunk,
  g_b -= beta_b * <g_b, m_hat_b> m_hat_b, with beta_b = min(k_s * |c_b| * conf_b, beta_max)
  and HeLoCo's confidence conf_b = |g_b| / (|g_b| + kappa |m_b|): the more directly a block
  opposes the heading, the more of its opposition is removed (a block that is nearly
  orthogonal, as noise is, keeps almost all of it), and the larger the update is beside the
  momentum, the more it could turn the trajectory, so the more of its conflict goes.

k_s (``strength``) and beta_max (``cap``) are the paper's shrinkage strength and cap. The share
of a block removed is beta_b * |c_b|, second order in the cosine: at k_s = 1, with block
cosines of -0.1 to -0.3 and a confidence of 0.1 to 0.3 (an outer momentum a few times longer
than one update), well under 1 % of a conflicting block goes, so k_s must be well above 1 for
the correction to act at all (measured: docs/bench-quality.md, bench.quality --sizing fixed-h).

Staleness enters as in the paper: an update computed from the model the replica now holds
(staleness 0) passes unchanged; every other one is judged against the momentum, whose
weighting by staleness is merge.weighting's. A correction never lengthens a block, so the norm
bound checked on the received update still holds for what is applied. The weakly aligned
"reorientation" regime of the paper (0 <= c_b < c_ok) is not implemented.

Consistency: the result is a pure function of (update, staleness, momentum). The momentum is
the replica's own outer state, which is a function of the sequence of updates it has applied;
replicas that applied the same updates in the same order compute bit-identical corrections,
and replicas that differ only in the order of their last few updates differ in the momentum
tail, and so by a correspondingly small amount here, as they already do in the outer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

CorrectionKind = Literal["none", "heloco", "lookahead"]
_TINY = 1e-30


@dataclass(frozen=True, kw_only=True)
class CorrectionConfig:
    """How stale updates are corrected before the outer step; part of the run fingerprint."""

    kind: CorrectionKind = "none"
    """none: apply updates as received; heloco: shrink the blocks of a stale update that
    conflict with the outer momentum (HeLoCo, arXiv 2606.00271); lookahead: updates are applied
    as received, and each learner starts its round where the outer momentum will have carried
    the replica by the time its update lands (:func:`look_ahead`)."""
    strength: float = 1.0
    """heloco: the shrinkage strength k_s, a conflicting block loses the share
    min(strength * |c| * confidence, cap) of its momentum component; lookahead: how many
    times the expected delay the start moves ahead; in [0, 100]."""
    cap: float = 1.0
    """HeLoCo's beta_max: the largest share of a block's momentum component removed, in [0, 1]."""
    block: int = 4096
    """Elements per block of the flat pseudo-gradient whose alignment is judged on its own."""
    kappa: float = 1.0
    """HeLoCo's confidence |g|/(|g| + kappa |m|): how strongly a long momentum (beside the
    update) tempers the correction."""

    def __post_init__(self) -> None:
        if self.kind not in get_args(CorrectionKind):
            raise ValueError(f"correction kind must be one of {get_args(CorrectionKind)}.")
        s = self.strength
        if not isinstance(s, int | float) or not (math.isfinite(s) and 0 <= s <= 100):
            raise ValueError(f"correction strength must be in [0, 100], got {s!r}.")
        c = self.cap
        if not isinstance(c, int | float) or not (math.isfinite(c) and 0 <= c <= 1):
            raise ValueError(f"correction cap must be in [0, 1], got {c!r}.")
        k = self.kappa
        if not isinstance(k, int | float) or not (math.isfinite(k) and k >= 0):
            raise ValueError(f"correction kappa must be a finite number >= 0, got {k!r}.")
        if type(self.block) is not int or self.block < 1:
            raise ValueError(f"correction block must be an integer >= 1, got {self.block!r}.")


@dataclass(frozen=True)
class Correction:
    """A corrected pseudo-gradient and how much of it was touched."""

    pseudo_gradient: torch.Tensor
    blocks_corrected: int
    blocks: int


def correct(
    config: CorrectionConfig, pseudo_gradient: torch.Tensor, staleness: int, momentum: torch.Tensor
) -> Correction:
    """The update as it is applied: ``pseudo_gradient`` itself, or a corrected copy.

    Pure: neither input is modified, and equal inputs give bit-identical outputs.
    """
    if pseudo_gradient.shape != momentum.shape or pseudo_gradient.dim() != 1:
        raise ValueError("pseudo_gradient and momentum must be 1-D tensors of one shape.")
    num_blocks = -(-pseudo_gradient.numel() // config.block)
    off = config.strength == 0 or config.cap == 0
    if config.kind != "heloco" or staleness <= 0 or off or num_blocks == 0:
        return Correction(pseudo_gradient, 0, num_blocks)
    g, m = _blocks(pseudo_gradient, config.block), _blocks(momentum, config.block)
    g_dot_m, m_sq, g_sq = _dot(g, m), _dot(m, m), _dot(g, g)
    g_norm, m_norm = g_sq.sqrt(), m_sq.sqrt()
    conflicting = (g_dot_m < 0) & (m_sq > _TINY)
    if not bool(conflicting.any()):
        return Correction(pseudo_gradient, 0, num_blocks)
    confidence = g_norm / torch.clamp(g_norm + config.kappa * m_norm, min=_TINY)
    cosine = torch.clamp(-g_dot_m / torch.clamp(g_norm * m_norm, min=_TINY), max=1.0)
    beta = torch.where(
        conflicting,
        torch.clamp(config.strength * cosine * confidence, max=config.cap),
        torch.zeros_like(confidence),
    )
    # g_b - beta * <g_b, m_b> / |m_b|^2 * m_b, zero for the blocks left alone.
    along = beta * g_dot_m / torch.clamp(m_sq, min=_TINY)
    corrected = (g - along.unsqueeze(1) * m).reshape(-1)[: pseudo_gradient.numel()]
    return Correction(corrected.contiguous(), int(conflicting.sum()), num_blocks)


def look_ahead(
    config: CorrectionConfig, params: torch.Tensor, momentum: torch.Tensor, rounds: float, lr: float
) -> torch.Tensor:
    """Where a learner starts its round: ``params`` (the replica), or with ``lookahead`` the
    replica moved on along the outer momentum by ``strength`` x ``rounds`` swarm rounds.

    Momentum look-ahead (Pluralis' delay-compensating Nesterov look-ahead, the asynchronous
    baseline HeLoCo compares with): under Delayed Nesterov the replica moves about
    ``lr * momentum`` per swarm round (the folded momentum, a sum of rounds' pseudo-gradients
    decayed by beta), so an update that will land ``rounds`` swarm rounds after its round
    started is best computed from there. ``rounds`` is the author's own estimate, e.g.
    :func:`expected_delay` of its previous update. The pseudo-gradient is taken from the
    returned start, so receivers apply it like any other: nothing about it depends on them.

    Pure: ``params`` itself when nothing moves, else a new tensor.
    """
    if params.shape != momentum.shape:
        raise ValueError("params and momentum must have one shape.")
    if not math.isfinite(rounds) or rounds < 0:
        raise ValueError(f"rounds must be a finite number >= 0, got {rounds!r}.")
    ahead = config.strength * rounds * lr
    if config.kind != "lookahead" or ahead == 0:
        return params
    return params - ahead * momentum


def expected_delay(staleness: int, learners: int) -> float:
    """Swarm rounds an author's next update is expected to land after its round starts: as
    many as passed while its previous round ran (its signed staleness over its M)."""
    if staleness < 0 or learners < 1:
        raise ValueError("staleness must be >= 0 and learners >= 1.")
    return staleness / learners


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products, without a temporary the size of the rows."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` as rows of ``block`` elements, the last one zero-padded."""
    pad = -flat.numel() % block
    padded = torch.nn.functional.pad(flat, (0, pad)) if pad else flat
    return padded.view(-1, block)
