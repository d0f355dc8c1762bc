from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from merge.correction import CorrectionConfig, correct, expected_delay, look_ahead

HELOCO = CorrectionConfig(kind="heloco", block=2)


def test_aligned_update_passes_unchanged() -> None:
    g = torch.tensor([1.0, 2.0, -1.0, 0.5])
    m = torch.tensor([2.0, 1.0, -3.0, 0.0])  # both blocks have a positive dot product

    result = correct(HELOCO, g, staleness=5, momentum=m)

    assert result.pseudo_gradient is g
    assert (result.blocks_corrected, result.blocks) == (0, 2)


def test_conflicting_block_loses_its_component_against_the_momentum() -> None:
    g = torch.tensor([1.0, 2.0, -2.0, 0.0, -1.0, 1.0])
    m = torch.tensor([2.0, 1.0, 4.0, 0.0, 4.0, 0.0])  # block 0 aligned; 1 opposed; 2 at 135 deg

    # kappa 0: full confidence, so the geometry alone decides.
    result = correct(CorrectionConfig(kind="heloco", block=2, kappa=0), g, 1, momentum=m)

    # block 1 is anti-parallel (c = -1): its whole momentum component goes
    # block 2: c = -1/sqrt(2), so that share of its component along m goes: -1 + 1/sqrt(2)
    expected = [1.0, 2.0, 0.0, 0.0, -1.0 + 0.5**0.5, 1.0]
    assert result.pseudo_gradient.tolist() == pytest.approx(expected, abs=1e-6)
    assert result.pseudo_gradient[:2].tolist() == [1.0, 2.0]  # aligned: bit-identical
    assert result.blocks_corrected == 2
    assert g.tolist() == [1.0, 2.0, -2.0, 0.0, -1.0, 1.0]  # inputs untouched
    assert m.tolist() == [2.0, 1.0, 4.0, 0.0, 4.0, 0.0]


def test_an_update_large_beside_the_momentum_is_corrected_more() -> None:
    # HeLoCo's confidence |g| / (|g| + kappa |m|): 4/5 of a long update's conflict goes,
    # 1/5 of a short one's (beside a long momentum it can turn the trajectory less).
    long, short = torch.tensor([-4.0, 0.0]), torch.tensor([-1.0, 0.0])

    assert correct(HELOCO, long, 2, torch.tensor([1.0, 0.0])).pseudo_gradient.tolist() == (
        pytest.approx([-0.8, 0.0])
    )
    assert correct(HELOCO, short, 2, torch.tensor([4.0, 0.0])).pseudo_gradient.tolist() == (
        pytest.approx([-0.8, 0.0])
    )


@pytest.mark.parametrize(
    ("config", "staleness", "momentum"),
    [
        (CorrectionConfig(kind="none", block=2), 3, [1.0, 0.0, 1.0, 0.0]),
        (HELOCO, 0, [1.0, 0.0, 1.0, 0.0]),  # a fresh update is not stale
        (HELOCO, 3, [0.0, 0.0, 0.0, 0.0]),  # no momentum yet: no heading to judge by
        (CorrectionConfig(kind="heloco", block=2, strength=0.0), 3, [1.0, 0.0, 1.0, 0.0]),
    ],
)
def test_uncorrected_cases_return_the_update_itself(
    config: CorrectionConfig, staleness: int, momentum: list[float]
) -> None:
    g = torch.tensor([-1.0, 0.0, -2.0, 1.0])

    assert correct(config, g, staleness, torch.tensor(momentum)).pseudo_gradient is g


def test_last_partial_block_is_judged_on_its_own() -> None:
    g = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0])
    m = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0])

    result = correct(HELOCO, g, 1, m)

    assert result.pseudo_gradient.tolist() == [1.0, 1.0, 1.0, 1.0, -0.5]  # confidence 1/2
    assert (result.blocks_corrected, result.blocks) == (1, 3)


def test_strength_above_one_removes_more_up_to_the_cap() -> None:
    # c = -1/sqrt(2) at kappa 0: k_s = 1 removes 0.707 of the component along m, k_s = 4 all
    # of it up to the cap (beta_max): a half-removed component at cap 0.5.
    g, m = torch.tensor([-1.0, 1.0]), torch.tensor([1.0, 0.0])

    def corrected(**kw: float) -> list[float]:
        config = CorrectionConfig(kind="heloco", block=2, kappa=0, **kw)
        return correct(config, g, 1, m).pseudo_gradient.tolist()

    assert corrected(strength=1.0) == pytest.approx([-1.0 + 0.5**0.5, 1.0])
    assert corrected(strength=4.0) == pytest.approx([0.0, 1.0])
    assert corrected(strength=4.0, cap=0.5) == pytest.approx([-0.5, 1.0])
    assert corrected(strength=4.0, cap=0.0) == [-1.0, 1.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kind": "pcgrad"},
        {"strength": -0.5},
        {"strength": 101.0},
        {"strength": float("nan")},
        {"cap": 1.5},
        {"cap": -0.1},
        {"block": 0},
        {"kappa": -1.0},
    ],
)
def test_invalid_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        CorrectionConfig(**kwargs)  # type: ignore[arg-type]


floats = st.floats(-4, 4, width=32, allow_subnormal=False)


@settings(max_examples=80, deadline=None)
@given(
    g_m=st.integers(1, 40).flatmap(
        lambda n: st.tuples(
            hnp.arrays("float32", n, elements=floats), hnp.arrays("float32", n, elements=floats)
        )
    ),
    block=st.integers(1, 8),
    strength=st.floats(0, 100),
    cap=st.floats(0, 1),
    staleness=st.integers(0, 20),
    kappa=st.floats(0, 4),
)
def test_correction_only_ever_removes_conflict(
    g_m: tuple[object, object],
    block: int,
    strength: float,
    cap: float,
    staleness: int,
    kappa: float,
) -> None:
    g, m = (torch.from_numpy(a.copy()) for a in g_m)  # type: ignore[attr-defined]
    config = CorrectionConfig(kind="heloco", block=block, strength=strength, cap=cap, kappa=kappa)

    out = correct(config, g, staleness, m).pseudo_gradient
    again = correct(config, g.clone(), staleness, m.clone()).pseudo_gradient

    assert torch.equal(out, again)  # deterministic: every replica computes the same
    tol = 1e-4
    for start in range(0, g.numel(), block):
        gb, mb, ob = g[start : start + block], m[start : start + block], out[start : start + block]
        dot = float(gb @ mb)
        if dot >= 0 or staleness == 0:
            assert torch.equal(ob, gb)  # aligned (or fresh) blocks pass unchanged
        else:
            assert float(ob.norm()) <= float(gb.norm()) + tol  # never lengthened
            assert dot - tol <= float(ob @ mb) <= tol  # less conflicting, never flipped over


LOOKAHEAD = CorrectionConfig(kind="lookahead", strength=2.0)


def test_look_ahead_moves_the_start_along_the_momentum_by_the_expected_delay() -> None:
    params, m = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, -1.0, 0.0])
    start = look_ahead(LOOKAHEAD, params, m, rounds=1.5, lr=0.7)
    torch.testing.assert_close(start, params - 2.0 * 1.5 * 0.7 * m)
    assert params.tolist() == [1.0, 2.0, 3.0] and m.tolist() == [0.5, -1.0, 0.0]  # pure


@pytest.mark.parametrize(
    ("config", "rounds"),
    [
        (LOOKAHEAD, 0.0),
        (CorrectionConfig(), 3.0),
        (HELOCO, 3.0),
        (replace(LOOKAHEAD, strength=0), 3.0),
    ],
)
def test_without_a_delay_or_the_look_ahead_the_start_is_the_replica(
    config: CorrectionConfig, rounds: float
) -> None:
    params = torch.tensor([1.0, 2.0])
    assert look_ahead(config, params, torch.tensor([1.0, 1.0]), rounds, lr=0.7) is params


def test_look_ahead_leaves_updates_to_the_merge_path_as_received() -> None:
    """Its correction is where the learner starts: the replicas apply what they receive."""
    g, m = torch.tensor([1.0, -1.0, -1.0, 0.0]), torch.tensor([-1.0, 1.0, 1.0, 0.0])
    result = correct(replace(LOOKAHEAD, block=2), g, 5, m)
    assert result.pseudo_gradient is g and result.blocks_corrected == 0


def test_expected_delay_is_the_last_update_staleness_in_swarm_rounds() -> None:
    assert expected_delay(6, 3) == 2.0
    assert expected_delay(0, 1) == 0.0
    with pytest.raises(ValueError):
        expected_delay(-1, 3)
    with pytest.raises(ValueError, match="rounds"):
        look_ahead(LOOKAHEAD, torch.zeros(2), torch.zeros(2), float("nan"), lr=0.7)


@given(
    st.lists(st.floats(-10, 10), min_size=1, max_size=16),
    st.floats(0, 100),
    st.floats(0, 5),
)
def test_look_ahead_is_a_step_along_the_momentum_only(
    values: list[float], strength: float, rounds: float
) -> None:
    params = torch.tensor(values)
    m = torch.linspace(-1, 1, len(values))
    config = CorrectionConfig(kind="lookahead", strength=strength)
    moved = params - look_ahead(config, params, m, rounds, lr=0.7)
    torch.testing.assert_close(moved, strength * rounds * 0.7 * m)
