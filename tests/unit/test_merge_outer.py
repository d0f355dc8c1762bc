import io

import pytest
import torch

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
    assert params.tolist() == [0.0, 0.0, 0.0]


def test_make_outer_optimizer_follows_the_config() -> None:
    assert isinstance(make_outer_optimizer(OuterConfig(kind="nesterov"), 3), NesterovSGD)
    delayed = make_outer_optimizer(OuterConfig(), 3)
    assert isinstance(delayed, DelayedNesterov)
    assert (delayed.lr, delayed.momentum, delayed.delay) == (0.7, 0.9, 4)


@pytest.mark.parametrize(
    "kwargs",
    [{"kind": "adam"}, {"lr": 0.0}, {"lr": float("inf")}, {"momentum": 1.0}, {"delay": 0}],
)
def test_invalid_outer_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        OuterConfig(**kwargs)  # type: ignore[arg-type]
