import math

import pytest
import torch

from node.model import (
    DEFAULT_BATCH_SIZE,
    DEFAULT_INNER_LR,
    GPT,
    PRESETS,
    ModelConfig,
    build_model,
    model_config,
)
from node.presets import MODEL_NAMES, MODEL_SIZES


@pytest.fixture(scope="module")
def param_counts() -> dict[str, int]:
    # Meta-device models count parameters without allocating them. Torch imports its
    # compiler stack (~1 s) on first use, so pay that once here rather than inside a test.
    counts = {}
    for preset in PRESETS:
        with torch.device("meta"):
            counts[preset] = GPT(model_config(preset)).num_params()
    return counts


@pytest.mark.parametrize(
    ("preset", "low", "high"),
    [("tiny", 100_000, 2_000_000), ("small", 8_000_000, 13_000_000), ("base", 110e6, 140e6)],
)
def test_preset_parameter_count_is_in_its_stated_range(
    param_counts: dict[str, int], preset: str, low: float, high: float
):
    assert low <= param_counts[preset] <= high


def test_meta_count_matches_a_built_model(param_counts: dict[str, int]):
    assert build_model(PRESETS["tiny"], seed=0).num_params() == param_counts["tiny"]


def test_every_preset_has_defaults():
    assert set(MODEL_NAMES) == set(DEFAULT_INNER_LR) == set(DEFAULT_BATCH_SIZE)
    assert set(PRESETS) == set(MODEL_SIZES)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="unknown model 'huge'; choose one of tiny"):
        model_config("huge")


def test_model_config_carries_the_vocab_size():
    assert model_config("small", vocab_size=512).vocab_size == 512
    assert model_config("small").as_dict()["n_embd"] == 384


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_layer": 0, "n_head": 4, "n_embd": 128, "block_size": 128},
        {"n_layer": 2, "n_head": 3, "n_embd": 128, "block_size": 128},
        {"n_layer": 2, "n_head": 4, "n_embd": 128, "block_size": 128, "dropout": 1.0},
    ],
)
def test_invalid_config_is_rejected(kwargs: dict[str, int | float]):
    with pytest.raises(ValueError):
        ModelConfig(**kwargs)  # type: ignore[arg-type]


def test_same_seed_gives_identical_parameters():
    a = build_model(PRESETS["tiny"], seed=7).state_dict()
    b = build_model(PRESETS["tiny"], seed=7).state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_different_seeds_give_different_parameters():
    a = build_model(PRESETS["tiny"], seed=7).wte.weight
    b = build_model(PRESETS["tiny"], seed=8).wte.weight
    assert not torch.equal(a, b)


def test_build_ignores_and_preserves_the_global_rng():
    torch.manual_seed(1)
    a = build_model(PRESETS["tiny"], seed=7).wte.weight
    after_build = torch.rand(1)
    torch.manual_seed(2)
    b = build_model(PRESETS["tiny"], seed=7).wte.weight
    torch.manual_seed(1)
    assert torch.equal(a, b)
    assert torch.equal(torch.rand(1), after_build)


def test_parameters_match_the_recorded_fingerprint():
    # Pins the init: nodes on other machines and torch builds must start from these values.
    w = build_model(PRESETS["tiny"], seed=0).wte.weight
    expected = torch.tensor([-0.04620823636651039, -0.007465017028152943, -0.02121633291244507])
    assert torch.equal(w[0, :3], expected)


def test_input_and_output_embeddings_are_tied():
    model = build_model(PRESETS["tiny"], seed=0)
    assert model.lm_head.weight is model.wte.weight


def test_initial_loss_is_near_uniform_over_bytes():
    model = build_model(PRESETS["tiny"], seed=0)
    data = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    logits, loss = model(data[:, :-1], data[:, 1:])
    assert logits.shape == (4, 64, 256)
    assert loss is not None and math.isfinite(loss.item())
    assert abs(loss.item() - math.log(256)) < 0.2


def test_forward_without_targets_returns_no_loss():
    _, loss = build_model(PRESETS["tiny"], seed=0)(torch.zeros(1, 8, dtype=torch.long))
    assert loss is None


def test_attention_is_causal():
    model = build_model(PRESETS["tiny"], seed=0).eval()
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 256
    assert torch.allclose(model(idx)[0][:, :-1], model(changed)[0][:, :-1], atol=1e-6)


def test_a_few_adamw_steps_lower_the_loss():
    model = build_model(PRESETS["tiny"], seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULT_INNER_LR["tiny"])
    data = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1], data[:, 1:]
    losses = []
    for _ in range(5):
        _, loss = model(x, y)
        assert loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3


def test_input_longer_than_block_size_is_rejected():
    model = build_model(PRESETS["tiny"], seed=0)
    with pytest.raises(ValueError, match="exceeds the model's block_size 128"):
        model(torch.zeros(1, 129, dtype=torch.long))
