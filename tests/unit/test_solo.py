"""merge.solo: updates trained alone as plain steps, the same on every replica in any order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.outer import DelayedNesterov, NesterovSGD, OuterOptimizer
from merge.solo import SoloConfig, solo_plain

NUMEL = 32
ON = SoloConfig(plain=True)

update = st.tuples(
    st.integers(0, 2**31 - 1),  # seed of the pseudo-gradient
    st.floats(0.05, 2.0),  # weight
    st.integers(0, 6),  # signed staleness
    st.integers(1, 6),  # learners it is sized by
)


def _optimizer(kind: str) -> OuterOptimizer:
    if kind == "nesterov":
        return NesterovSGD(lr=0.7, momentum=0.9, numel=NUMEL)
    return DelayedNesterov(lr=0.7, momentum=0.9, numel=NUMEL)


def _settled(kind: str, updates: list[tuple[int, float, int, int]]) -> torch.Tensor:
    """Applies the updates as the rule says, then where the params rest once the momentum
    has played out (what replicas' drift compares)."""
    outer, params = _optimizer(kind), torch.linspace(-1, 1, NUMEL)
    for seed, weight, staleness, learners in updates:
        g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed)) * 0.1
        if solo_plain(ON, staleness, learners):
            outer.plain_step(params, g, weight, learners)
        else:
            outer.step(params, g, weight, learners)
    point = params.double()
    for coefficient, buffer in outer.rest_terms():
        point += coefficient * buffer.double()
    return point


def test_off_by_default_and_on_only_for_staleness_zero_in_a_swarm() -> None:
    assert not solo_plain(SoloConfig(), 0, 4)
    assert solo_plain(ON, 0, 4)
    assert not solo_plain(ON, 1, 4)
    assert not solo_plain(ON, 0, 1)  # one learner: every update is signed 0, as DiLoCo's


@pytest.mark.parametrize(("staleness", "learners"), [(-1, 4), (0, 0), (1.0, 4), (0, True)])
def test_bad_counts_are_refused(staleness: object, learners: object) -> None:
    with pytest.raises(ValueError):
        solo_plain(ON, staleness, learners)  # type: ignore[arg-type]


def test_the_setting_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="bool"):
        SoloConfig(plain=1)  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    updates=st.lists(update, min_size=1, max_size=20),
    data=st.data(),
    kind=st.sampled_from(["nesterov", "delayed_nesterov"]),
)
def test_replicas_taking_one_set_in_any_order_settle_to_one_point(
    updates: list[tuple[int, float, int, int]], data: st.DataObject, kind: str
) -> None:
    """The rule reads only the update's signed staleness and sized learner count, and plain
    steps commute with every step: the settled point depends on the set alone."""
    reordered = data.draw(st.permutations(updates))
    one, other = _settled(kind, updates), _settled(kind, reordered)
    assert float((one - other).norm()) <= 1e-5 * max(float(one.norm()), 1.0)


def test_a_burst_of_solo_updates_builds_no_momentum() -> None:
    outer, params = _optimizer("delayed_nesterov"), torch.zeros(NUMEL)
    g = torch.ones(NUMEL)
    for _ in range(8):  # two rounds' worth of a 4-learner swarm's updates trained alone
        assert solo_plain(ON, 0, 4)
        outer.plain_step(params, g, 1.0, 4)
    assert not bool(outer.momentum_buffer.any())
    assert torch.allclose(params, -0.7 * 8 / 4 * g)  # each its plain share, nothing more
