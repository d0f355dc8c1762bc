"""hf: models: transformers architectures built from the genesis seed, nothing downloaded."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from node.config import JoinConfig
from node.model import DEFAULT_BATCH_SIZE, DEFAULT_INNER_LR, build_model, model_config

# Checked, not imported: importing transformers took ~1.4 s of each xdist worker's collection
# (both workers collect every module; only one runs these tests, which import it themselves).
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason='hf: models need the extra: pip install -e ".[hf]"',
)

ARCHS = ["hf:llama-tiny", "hf:gpt2-tiny"]


@pytest.mark.parametrize("name", ARCHS)
def test_same_seed_gives_identical_parameters_and_keeps_the_global_rng(name: str) -> None:
    torch.manual_seed(1)
    a = build_model(model_config(name), seed=7).state_dict()
    after_build = torch.rand(1)
    torch.manual_seed(2)
    b = build_model(model_config(name), seed=7).state_dict()
    torch.manual_seed(1)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert torch.equal(torch.rand(1), after_build)


@pytest.mark.parametrize("name", ARCHS)
def test_parameters_match_the_recorded_fingerprint(name: str) -> None:
    # Pins the init: drawn in float64 on the CPU, identical on every machine and torch build.
    model = build_model(model_config(name), seed=0)
    first = next(model.parameters())
    expected = torch.tensor([-0.04620823636651039, -0.007465017028152943, -0.02121633291244507])
    assert torch.equal(first[0, :3], expected)
    other = next(build_model(model_config(name), seed=1).parameters())
    assert not torch.equal(first, other)


def test_the_architecture_is_the_transformers_one() -> None:
    llama = build_model(model_config("hf:llama-tiny"), seed=0)
    gpt2 = build_model(model_config("hf:gpt2-tiny"), seed=0)
    assert type(llama.hf).__name__ == "LlamaForCausalLM"
    assert type(gpt2.hf).__name__ == "GPT2LMHeadModel"
    assert llama.hf.config.vocab_size == gpt2.hf.config.vocab_size == 256
    assert llama.hf.config.num_hidden_layers == 2 and llama.hf.config.hidden_size == 128


@pytest.mark.parametrize("name", ARCHS)
def test_initial_loss_is_near_uniform_and_adamw_lowers_it(name: str) -> None:
    model = build_model(model_config(name), seed=0)
    data = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    x, y = data[:, :-1], data[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEFAULT_INNER_LR[name])
    losses = []
    for _ in range(5):
        logits, loss = model(x, y)
        assert logits.shape == (4, 32, 256) and loss is not None
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(256)) < 0.2
    assert losses[-1] < losses[0] - 0.3


def test_attention_is_causal_and_long_inputs_are_refused() -> None:
    model = build_model(model_config("hf:llama-tiny"), seed=0).eval()
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, -1] = (idx[0, -1] + 1) % 256
    assert torch.allclose(model(idx)[0][:, :-1], model(changed)[0][:, :-1], atol=1e-6)
    with pytest.raises(ValueError, match="exceeds the model's block_size 128"):
        model(torch.zeros(1, 129, dtype=torch.long))


def test_names_carry_the_size_presets_and_the_architecture() -> None:
    config = model_config("hf:gpt2-small", vocab_size=512)
    assert (config.n_layer, config.n_embd, config.block_size, config.vocab_size) == (
        6,
        384,
        256,
        512,
    )
    assert config.as_dict()["arch"] == "gpt2"  # enters the run fingerprint
    assert DEFAULT_BATCH_SIZE["hf:llama-base"] == DEFAULT_BATCH_SIZE["base"]
    assert JoinConfig(model="hf:llama-base").model == "hf:llama-base"
    with pytest.raises(ValueError, match="hf:llama-tiny"):
        JoinConfig(model="hf:llama")
