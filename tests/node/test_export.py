"""`diloco-node export`: a trained node's checkpoint loads elsewhere with the same logits."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from node.checkpoint import read_checkpoint
from node.cli import main
from node.config import JoinConfig
from node.events import RecordingEventLog
from node.export import checkpoint_model, load_flat_
from node.model import build_model, model_config
from node.runtime import Node
from tests.conftest import REPO

needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason='loading the export needs transformers: pip install -e ".[hf]"',
)


def _train(tmp_path: Path, model: str) -> Path:
    """One real round of a node, checkpointed: the replica holds a merged update."""
    config = JoinConfig(
        model=model,
        data=str(Path(torch.__file__).parent / "functional.py"),
        inner_steps=2,
        batch_size=2,
        eval_batches=0,
        max_rounds=1,
        identity=str(tmp_path / "id.key"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        swarm=False,
    )
    Node(config, RecordingEventLog()).run()
    return tmp_path / "ckpt"


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory.mktemp("tiny"), "tiny")


def _export(checkpoint_dir: Path, out: Path, model: str) -> None:
    state = read_checkpoint(checkpoint_dir)
    assert state is not None and checkpoint_model(state) == (model, 256)
    assert main(["export", "--checkpoint-dir", str(checkpoint_dir), "--out", str(out)]) == 0


def _replica_model(checkpoint_dir: Path, model: str) -> torch.nn.Module:
    state = read_checkpoint(checkpoint_dir)
    assert state is not None and state["replica"]["num_applied"] == 1
    module = build_model(model_config(model), seed=12345)
    load_flat_(module, state["replica"]["params"])
    return module.eval()


def _bytes() -> torch.Tensor:
    return torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))


@needs_transformers
@pytest.mark.parametrize("model", ["tiny", "hf:llama-tiny"])
def test_transformers_loads_the_export_with_the_same_logits(
    tmp_path: Path, tiny_checkpoint: Path, model: str
) -> None:
    from transformers import AutoModelForCausalLM

    checkpoint_dir = tiny_checkpoint if model == "tiny" else _train(tmp_path, model)
    _export(checkpoint_dir, tmp_path / "out", model)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        expected, _ = _replica_model(checkpoint_dir, model)(_bytes())
        actual = loaded(_bytes()).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_the_documented_loader_runs_the_builtin_export_with_plain_torch(
    tmp_path: Path, tiny_checkpoint: Path
) -> None:
    checkpoint_dir = tiny_checkpoint
    _export(checkpoint_dir, tmp_path / "out", "tiny")
    page = (REPO / "docs" / "export.md").read_text()
    match = re.search(r"<!-- export-loader -->\n```python\n(.*?)```", page, re.S)
    assert match, "docs/export.md lost its export loader snippet"
    namespace: dict[str, Any] = {}
    exec(match.group(1), namespace)
    with torch.no_grad():
        expected, _ = _replica_model(checkpoint_dir, "tiny")(_bytes())
        actual = namespace["gpt2_logits"](str(tmp_path / "out"), _bytes())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert (tmp_path / "out" / "diloco.json").exists()


def test_export_refuses_a_missing_checkpoint_and_a_wrong_model(
    tmp_path: Path, tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = ["export", "--checkpoint-dir", str(tmp_path / "none"), "--out", str(tmp_path / "o")]
    assert main(empty) == 1
    assert "no checkpoint in" in capsys.readouterr().err
    args = ["export", "--checkpoint-dir", str(tiny_checkpoint), "--out", str(tmp_path / "o")]
    assert main([*args, "--model", "small"]) == 1
    assert "small" in capsys.readouterr().err
    assert not (tmp_path / "o" / "model.safetensors").exists()
