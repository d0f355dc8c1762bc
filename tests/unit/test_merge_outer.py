import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.outer import (
    DelayedNesterov,
    NesterovSGD,
    OuterConfig,
    OuterOptimizer,
    make_outer_optimizer,
)

# Dyadic numbers keep every step exact, so results compare with ==.
START = [1.0, -2.0]
STEPS = [([2.0, 4.0], 0.5), ([1.0, 0.0], 1.0), ([0.0, 4.0], 0.25), ([1.0, 1.0], 2.0)]
# weighted pseudo-gradients g' = w*g: [1, 2], [1, 0], [0, 1], [2, 2]


def run_steps(optimizer: OuterOptimizer, num_steps: int) -> list[list[float]]:
    params = torch.tensor(START)
    trajectory = []
    for g, weight in STEPS[:num_steps]:
        optimizer.step(params, torch.tensor(g), weight)
        trajectory.append(params.tolist())
    return trajectory


def test_nesterov_matches_hand_computed_steps() -> None:
    # lr 0.5, m 0.5; buf = g' on the first step, then m*buf + g'; p -= lr*(g' + m*buf)
    trajectory = run_steps(NesterovSGD(lr=0.5, momentum=0.5, numel=2), 3)

    assert trajectory == [
        [0.25, -3.5],  # buf [1, 2]; p -= 0.5*[1.5, 3]
        [-0.625, -3.75],  # buf [1.5, 1]; p -= 0.5*[1.75, 0.5]
        [-0.8125, -4.625],  # buf [0.75, 1.5]; p -= 0.5*[0.375, 1.75]
    ]


def test_delayed_nesterov_matches_hand_computed_steps() -> None:
    # lr 0.5, m 0.5, N 2: p -= lr*g'/N each step; every 2nd: buf = m*buf + acc/N, p -= lr*m*buf
    optimizer = DelayedNesterov(lr=0.5, momentum=0.5, delay=2, numel=2)

    trajectory = run_steps(optimizer, 4)

    assert trajectory == [
        [0.75, -2.5],  # acc [1, 2]
        [0.25, -2.75],  # plain to [0.5, -2.5]; buf [1, 1]; p -= 0.25*[1, 1]
        [0.25, -3.0],  # acc [0, 1]
        [-0.625, -4.0],  # plain to [-0.25, -3.5]; buf [1.5, 2]; p -= 0.25*[1.5, 2]
    ]
    state = optimizer.state_dict()
    assert state["buf"].tolist() == [1.5, 2.0]  # type: ignore[attr-defined]
    assert state["acc"].tolist() == [0.0, 0.0]  # type: ignore[attr-defined]
    assert state["count"] == 4


def test_delayed_nesterov_with_delay_one_is_nesterov() -> None:
    nesterov = run_steps(NesterovSGD(lr=0.5, momentum=0.5, numel=2), 4)
    delayed = run_steps(DelayedNesterov(lr=0.5, momentum=0.5, delay=1, numel=2), 4)
    assert delayed == nesterov

    generator = torch.Generator().manual_seed(0)
    p_nesterov = torch.randn(100, generator=generator)
    p_delayed = p_nesterov.clone()
    a = NesterovSGD(lr=0.7, momentum=0.9, numel=100)
    b = DelayedNesterov(lr=0.7, momentum=0.9, delay=1, numel=100)
    for weight in (1.0, 0.5, 0.3, 2.0, 0.9):
        g = torch.randn(100, generator=generator)
        a.step(p_nesterov, g, weight)
        b.step(p_delayed, g, weight)
    assert torch.allclose(p_delayed, p_nesterov, rtol=1e-6, atol=1e-6)


def test_nesterov_is_torch_sgd_with_nesterov_momentum() -> None:
    generator = torch.Generator().manual_seed(1)
    start = torch.randn(1000, generator=generator)
    params = start.clone()
    reference = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=0.7, momentum=0.9, nesterov=True)
    ours = NesterovSGD(lr=0.7, momentum=0.9, numel=1000)

    for weight in (1.0, 0.25, 0.6, 1.5, 0.1, 0.8):
        g = torch.randn(1000, generator=generator)
        ours.step(params, g, weight)
        reference.grad = g * weight
        sgd.step()
        assert torch.equal(params, reference.detach())


@pytest.mark.parametrize("kind", ["nesterov", "delayed_nesterov"])
def test_state_dict_round_trip_resumes_identically(kind: str) -> None:
    config = OuterConfig(kind=kind, delay=3)  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(2)
    grads = [torch.randn(50, generator=generator) for _ in range(7)]
    params = torch.randn(50, generator=generator)
    original = make_outer_optimizer(config, 50)
    for g in grads[:4]:
        original.step(params, g, 0.5)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)
    buffer.seek(0)
    resumed = make_outer_optimizer(config, 50)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    resumed_params = params.clone()

    for g in grads[4:]:
        original.step(params, g, 0.5)
        resumed.step(resumed_params, g, 0.5)

    assert torch.equal(resumed_params, params)


def test_load_state_dict_refuses_the_wrong_shape_or_kind() -> None:
    optimizer = make_outer_optimizer(OuterConfig(), 4)
    state = optimizer.state_dict()

    with pytest.raises(ValueError):
        make_outer_optimizer(OuterConfig(), 5).load_state_dict(state)
    with pytest.raises(ValueError):
        make_outer_optimizer(OuterConfig(kind="nesterov"), 4).load_state_dict(state)
    with pytest.raises(ValueError):
        optimizer.load_state_dict({**state, "count": -1})


def test_step_refuses_mismatched_inputs() -> None:
    optimizer = make_outer_optimizer(OuterConfig(), 3)
    params = torch.zeros(3)

    with pytest.raises(ValueError):
        optimizer.step(params, torch.zeros(4), 1.0)
    with pytest.raises(ValueError):
        optimizer.step(params, torch.zeros(3, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError):
        optimizer.step(params, torch.zeros(3), float("nan"))
    with pytest.raises(ValueError):
        optimizer.step(params, torch.zeros(3), 1.0, learners=0)
    assert params.tolist() == [0.0, 0.0, 0.0]


def test_make_outer_optimizer_follows_the_config() -> None:
    assert isinstance(make_outer_optimizer(OuterConfig(kind="nesterov"), 3), NesterovSGD)
    delayed = make_outer_optimizer(OuterConfig(), 3)
    assert isinstance(delayed, DelayedNesterov)
    assert (delayed.lr, delayed.momentum, delayed.delay) == (0.7, 0.9, None)


@pytest.mark.parametrize(
    "kwargs",
    [{"kind": "adam"}, {"lr": 0.0}, {"lr": float("inf")}, {"momentum": 1.0}, {"delay": 0}],
)
def test_invalid_outer_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        OuterConfig(**kwargs)  # type: ignore[arg-type]


def sync_diloco_step(
    params: torch.Tensor, sgd: torch.optim.SGD, reference: torch.nn.Parameter, mean: torch.Tensor
) -> None:
    """One synchronous DiLoCo outer step on the mean pseudo-gradient (torch's Nesterov SGD)."""
    reference.grad = mean.clone()
    sgd.step()


@settings(max_examples=20, deadline=None)
@given(
    learners=st.integers(1, 64),
    momentum=st.sampled_from([0.0, 0.5, 0.9, 0.95]),
    lr=st.sampled_from([0.1, 0.7, 1.0]),
    kind=st.sampled_from(["nesterov", "delayed_nesterov"]),
    seed=st.integers(0, 2**16),
)
def test_rounds_of_m_equal_updates_are_sync_nesterov_steps(
    learners: int, momentum: float, lr: float, kind: str, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    start = torch.randn(8, generator=generator)
    ours = make_outer_optimizer(OuterConfig(kind=kind, lr=lr, momentum=momentum), 8)  # type: ignore[arg-type]
    reference = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([reference], lr=lr, momentum=momentum, nesterov=momentum > 0)
    params = start.clone()
    for _ in range(3):  # three rounds, so the momentum carries over
        g = torch.randn(8, generator=generator)
        for _ in range(learners):
            ours.step(params, g, 1.0, learners)
        sync_diloco_step(params, sgd, reference, g)
        assert torch.allclose(params, reference.detach(), rtol=1e-5, atol=1e-5)


def test_delayed_nesterov_folds_the_momentum_once_per_round_of_shares() -> None:
    # lr 1, m 0.5. Two updates of a 4-learner swarm, then one of a 2-learner swarm: 1/4 + 1/4
    # + 1/2 is one round, so the momentum is folded on the third update, not before.
    optimizer = DelayedNesterov(lr=1.0, momentum=0.5, numel=1)
    params = torch.tensor([0.0])
    for learners, expected in ((4, -1.0), (4, -2.0), (2, -6.0)):
        optimizer.step(params, torch.tensor([4.0]), 1.0, learners)
        assert params.tolist() == [expected]
    # plain steps 1 + 1 + 2; then buf = 0.5*0 + (1 + 1 + 2) = 4, params -= 1 * 0.5 * 4
    assert optimizer.state_dict()["buf"].tolist() == [4.0]  # type: ignore[attr-defined]
    assert optimizer.state_dict()["progress"] == 0.0


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 32), min_size=1, max_size=60))
def test_delayed_nesterov_folds_once_per_whole_round(counts: list[int]) -> None:
    optimizer = DelayedNesterov(lr=1.0, momentum=0.5, numel=1)
    params = torch.tensor([0.0])
    folds = 0
    for learners in counts:
        before = optimizer.state_dict()["buf"].clone()  # type: ignore[attr-defined]
        optimizer.step(params, torch.tensor([1.0]), 1.0, learners)
        folds += not torch.equal(before, optimizer.state_dict()["buf"])
    assert folds == int(sum(1 / m for m in counts) + 1e-9)
    assert 0.0 <= optimizer.state_dict()["progress"] < 1.0  # type: ignore[operator]


def test_delayed_nesterov_state_without_progress_loads_as_a_round_start() -> None:
    optimizer = DelayedNesterov(lr=1.0, momentum=0.5, numel=2)
    state = optimizer.state_dict()
    del state["progress"]

    optimizer.load_state_dict(state)

    with pytest.raises(ValueError):
        optimizer.load_state_dict({**state, "progress": 1.5})


@settings(max_examples=20, deadline=None)
@given(st.sampled_from(["nesterov", "delayed_nesterov"]), st.lists(st.integers(1, 4), max_size=9))
def test_momentum_parts_sum_to_the_momentum_direction(kind: str, counts: list[int]) -> None:
    optimizer = make_outer_optimizer(OuterConfig(kind=kind), 3)  # type: ignore[arg-type]
    params, generator = torch.zeros(3), torch.Generator().manual_seed(len(counts))
    for learners in counts:
        optimizer.step(params, torch.randn(3, generator=generator), 1.0, learners)
        direction, parts = optimizer.momentum_direction(), optimizer.momentum_parts()
        assert direction is not None and torch.equal(sum(parts), direction)  # type: ignore[arg-type]
    assert counts or optimizer.momentum_parts() == []
