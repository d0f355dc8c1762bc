"""node.inner_optim.InnerAdamW steps exactly as torch.optim.AdamW and shares its state_dict,
so checkpoints written before it (by torch.optim.AdamW) resume, and it never imports
torch._dynamo (the reason it exists)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node.inner_optim import InnerAdamW
from tests.conftest import REPO

SETTINGS = {"lr": 3e-3, "weight_decay": 0.1, "betas": (0.9, 0.95)}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _train(model: torch.nn.Module, optimizer: object, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 5, generator=generator)
        optimizer.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
        model(x).pow(2).mean().backward()
        optimizer.step()  # type: ignore[attr-defined]


def _same_params(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@settings(max_examples=15, deadline=None)
@given(steps=st.integers(1, 6), seed=st.integers(0, 1000), lr=st.floats(1e-4, 1e-1))
def test_steps_are_bit_identical_to_torch_adamw(steps: int, seed: int, lr: float) -> None:
    ours, theirs = _model(seed), _model(seed)
    settings_ = {**SETTINGS, "lr": lr}
    _train(ours, InnerAdamW(ours.parameters(), **settings_), steps, seed)
    _train(theirs, torch.optim.AdamW(theirs.parameters(), **settings_, fused=False), steps, seed)
    assert _same_params(ours, theirs)


def test_state_dict_has_torch_adamw_layout() -> None:
    ours, theirs = _model(0), _model(0)
    mine = InnerAdamW(ours.parameters(), **SETTINGS)
    torchs = torch.optim.AdamW(theirs.parameters(), **SETTINGS, fused=False)
    _train(ours, mine, 2, 1)
    _train(theirs, torchs, 2, 1)
    a, b = mine.state_dict(), torchs.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert list(a["param_groups"][0]) == list(b["param_groups"][0])  # key order too
    assert a["state"].keys() == b["state"].keys()
    for index, state in b["state"].items():
        assert state.keys() == a["state"][index].keys()
        for name, value in state.items():
            assert value.dtype == a["state"][index][name].dtype
            assert torch.equal(value, a["state"][index][name])


@pytest.mark.parametrize("writer", ["torch", "ours"])
def test_a_saved_state_resumes_bit_identically_in_either(writer: str) -> None:
    """A checkpoint of torch.optim.AdamW (every checkpoint before this class) resumes in
    InnerAdamW, and the other way round: the next steps match training without a restart."""
    through, reference = _model(2), _model(2)
    make = {
        "torch": lambda m: torch.optim.AdamW(m.parameters(), **SETTINGS, fused=False),
        "ours": lambda m: InnerAdamW(m.parameters(), **SETTINGS),
    }
    other = "ours" if writer == "torch" else "torch"
    first = make[writer](through)
    _train(through, first, 3, 5)
    resumed_model = _model(9)
    resumed_model.load_state_dict(through.state_dict())
    resumed = make[other](resumed_model)
    resumed.load_state_dict(first.state_dict())
    _train(resumed_model, resumed, 3, 6)
    ref_optimizer = make[writer](reference)
    _train(reference, ref_optimizer, 3, 5)
    _train(reference, ref_optimizer, 3, 6)
    assert _same_params(resumed_model, reference)


def test_a_state_of_another_layout_is_refused() -> None:
    small = torch.nn.Linear(2, 2)
    saved = InnerAdamW(small.parameters(), **SETTINGS).state_dict()
    with pytest.raises(ValueError, match="another parameter layout"):
        InnerAdamW(_model(0).parameters(), **SETTINGS).load_state_dict(saved)


def test_training_and_resuming_never_import_dynamo() -> None:
    script = """
import sys, torch
from node.inner_optim import InnerAdamW
model = torch.nn.Linear(3, 2)
optimizer = InnerAdamW(model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
model(torch.ones(1, 3)).sum().backward()
optimizer.step()
optimizer.zero_grad()
optimizer.load_state_dict(optimizer.state_dict())
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
