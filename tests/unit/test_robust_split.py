"""The robust judge split into statistics and decision (merge.robust `decide`): the split gives
exactly the verdicts the judge gave before it, and deciding from per-shard sums (what a group
whose members each hold one shard of an update has: merge.shard_round) gives the verdict of
the whole tensor."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge import robust as robust_module
from merge.group_plan import shard_bounds
from merge.robust import RobustConfig, RobustFilter, Verdict

NUMEL = 40


def _judge_before(
    self: RobustFilter,
    pseudo_gradient: torch.Tensor,
    momentum: list[torch.Tensor],
    norm: float | None,
    *,
    fresh: bool,
    spans: int,
) -> Verdict:
    """RobustFilter.judge as it was before the split (main at b22363c), verbatim but for the
    helpers' module prefix: the reference the split must reproduce exactly."""
    voters = None
    if norm is None:
        norm = float(torch.linalg.vector_norm(pseudo_gradient))
    median = self.median_norm(voters)
    bound = self.config.max_norm_to_median
    parts = robust_module._parts(momentum)
    scale = 1.0
    if median is not None and bound > 0 and norm > bound * median:
        scale = bound * median / norm
    dot = robust_module._dot(pseudo_gradient, parts) if parts and norm > 0 else None
    cosine = None
    if dot is not None and (scale < 1 or not (dot >= 0 and self.config.min_cosine < 0)):
        cosine = _cosine_before(dot, norm, parts)
    if cosine is not None and cosine < self.config.min_cosine:
        return Verdict("against_momentum", norm, median, cosine)
    reason = "norm_outlier" if scale < 1 else None
    radius = self.config.fresh_center_radius if fresh else self.config.center_radius
    if scale == 1:
        radius *= max(1, spans)
    if median is None or dot is None or radius == 0 or median == 0:
        return Verdict(reason, norm, median, cosine, scale)
    recentered = _recenter_before(norm * scale, dot * scale, median, radius * median, parts)
    if recentered is None:
        return Verdict(reason, norm, median, cosine, scale)
    return Verdict(reason or "off_center", norm, median, cosine, scale, *recentered)


def _m_norm(parts: list[torch.Tensor]) -> float:
    if len(parts) == 1:
        return float(torch.linalg.vector_norm(parts[0]))
    return robust_module._norm_of_sum(parts)


def _cosine_before(dot: float, g_norm: float, parts: list[torch.Tensor]) -> float | None:
    m_norm = _m_norm(parts)
    if m_norm == 0 or not math.isfinite(m_norm):
        return None
    return dot / g_norm / m_norm


def _recenter_before(
    norm: float, dot: float, reference: float, radius: float, parts: list[torch.Tensor]
) -> tuple[float, float] | None:
    if dot >= 0 and norm * norm + reference * reference <= radius * radius:
        return None
    m_norm = _m_norm(parts)
    if m_norm == 0 or not math.isfinite(m_norm):
        return None
    squared = norm * norm + reference * reference - 2.0 * reference * dot / m_norm
    deviation = math.sqrt(max(0.0, squared))
    if deviation <= radius:
        return None
    return radius / deviation, reference / m_norm


def _filter(seed: int, recorded: int) -> RobustFilter:
    """A filter holding `recorded` norms of a few authors (none: still in warm-up)."""
    generator = torch.Generator().manual_seed(seed)
    robust = RobustFilter(RobustConfig())
    for i in range(recorded):
        norm = float(torch.rand((), generator=generator)) * 2 + 0.1
        robust.record(Verdict(None, norm, robust.median_norm(), None), f"author{i % 3}")
    return robust


def _case(seed: int, parts: int, along: float, size: float) -> tuple[torch.Tensor, list]:
    """An update `along` the momentum plus noise, scaled by `size`; the momentum in `parts`."""
    generator = torch.Generator().manual_seed(seed)
    momentum = [torch.randn(NUMEL, generator=generator) for _ in range(parts)]
    direction = sum(momentum, torch.zeros(NUMEL))
    noise = torch.randn(NUMEL, generator=generator)
    g = along * direction / max(float(direction.norm()), 1e-6) + noise / float(noise.norm())
    return (g * size).to(torch.float32), momentum


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    recorded=st.integers(0, 12),
    parts=st.integers(0, 2),
    along=st.floats(-3, 3),
    size=st.sampled_from([0.0, 0.05, 0.5, 1.0, 3.0, 20.0]),
    given_norm=st.booleans(),
    fresh=st.booleans(),
    spans=st.integers(1, 4),
)
def test_the_split_judge_gives_exactly_the_verdicts_of_before(
    seed: int,
    recorded: int,
    parts: int,
    along: float,
    size: float,
    given_norm: bool,
    fresh: bool,
    spans: int,
) -> None:
    robust = _filter(seed, recorded)
    g, momentum = _case(seed, parts, along, size)
    norm = float(torch.linalg.vector_norm(g)) if given_norm else None
    before = _judge_before(robust, g, momentum, norm, fresh=fresh, spans=spans)
    after = robust.judge(g, momentum, norm, fresh=fresh, spans=spans)
    assert after == before  # every figure, bit for bit


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    recorded=st.integers(4, 12),
    parts=st.integers(1, 2),
    along=st.floats(-3, 3),
    size=st.sampled_from([0.05, 0.5, 1.0, 3.0, 20.0]),
    shards=st.integers(1, 7),
)
def test_deciding_from_per_shard_sums_gives_the_verdict_of_the_whole_tensor(
    seed: int, recorded: int, parts: int, along: float, size: float, shards: int
) -> None:
    """Each shard holder sums its shard's squared norm and dot products (with the momentum's
    parts and theirs with each other); the verdict decided from the sums of those is the
    whole tensor's, its figures within float rounding."""
    robust = _filter(seed, recorded)
    g, momentum = _case(seed, parts, along, size)
    whole = robust.judge(g, momentum)
    sums: dict[str, list[float]] = {"gg": [], "gm": [], "mm": []}
    for start, end in shard_bounds(NUMEL, shards):
        piece, m_pieces = g[start:end].double(), [m[start:end].double() for m in momentum]
        m_piece = sum(m_pieces, torch.zeros(end - start, dtype=torch.float64))
        sums["gg"].append(float(piece @ piece))
        sums["gm"].append(float(piece @ m_piece))
        sums["mm"].append(float(m_piece @ m_piece))
    norm = math.sqrt(math.fsum(sums["gg"]))
    dot = math.fsum(sums["gm"])
    decided = robust.decide(norm, dot, lambda: math.sqrt(math.fsum(sums["mm"])))
    assert decided.reason == whole.reason
    for field in ("norm", "median_norm", "cosine", "scale", "recenter", "center"):
        a, b = getattr(decided, field), getattr(whole, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (field, a, b)
