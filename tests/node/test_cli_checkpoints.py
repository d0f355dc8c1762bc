"""Checkpoints as a newcomer meets them (issue 24, items 3-5): the command, the line seen."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from node.checkpoint import save_checkpoint
from node.cli import main
from node.model import build_model, model_config

SMALL_CORPUS = str(Path(torch.__file__).parent / "functional.py")


def _tiny_join(home: Path, checkpoint_dir: Path, *extra: str) -> list[str]:
    return [
        "join", "--model", "tiny", "--data", SMALL_CORPUS, "--identity", str(home / "id.key"),
        "--checkpoint-dir", str(checkpoint_dir), "--inner-steps", "2", "--eval-batches", "0",
        "--no-swarm", "--no-dashboard", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A node's checkpoint after one real round (2 inner steps of tiny)."""
    home = tmp_path_factory.mktemp("trained")
    assert main(_tiny_join(home, home / "ckpt", "--max-rounds", "1")) == 0
    return home / "ckpt"


def _failure(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    return err.splitlines()[-1]


def test_export_of_a_run_dir_with_several_nodes_lists_them(
    tmp_path: Path, trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "checkpoints" / "diloco-default"
    for peer in ("12D3KooWAlice", "12D3KooWBob"):
        shutil.copytree(trained, run_dir / peer, ignore=shutil.ignore_patterns(".lock"))
    line = _failure(capsys, ["export", "--checkpoint-dir", str(run_dir), "--out", "unused"])
    assert f"{run_dir} holds the checkpoints of 2 nodes; pass one of them" in line
    assert f"{run_dir / '12D3KooWAlice'} (1 rounds done)" in line
    assert f"{run_dir / '12D3KooWBob'} (1 rounds done)" in line
    assert not Path("unused").exists()
    out = tmp_path / "model"
    bob = run_dir / "12D3KooWBob"
    assert main(["export", "--checkpoint-dir", str(bob), "--out", str(out)]) == 0
    assert "replica of round 1" in capsys.readouterr().out
    assert (out / "model.safetensors").exists()


def test_exporting_an_untrained_replica_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = build_model(model_config("tiny"), seed=0)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    layout = [(name, p.shape) for name, p in model.named_parameters()]
    state = {
        "fingerprint": "ab" * 32,
        "model": {"name": "tiny", "vocab_size": 256},
        "round": 0,
        "replica": {"params": params, "num_applied": 0},
    }
    save_checkpoint(tmp_path / "ckpt", state, layout)
    assert main(["export", "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "replica of round 0" in captured.out
    assert captured.err.strip() == (
        "diloco-node: warning: this replica has merged no update yet: the exported model is "
        "untrained (the run's initial weights)"
    )


def test_resuming_a_checkpoint_of_other_settings_names_them_and_the_flag(
    tmp_path: Path, trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(trained, checkpoint, ignore=shutil.ignore_patterns(".lock"))
    argv = _tiny_join(tmp_path, checkpoint, "--max-rounds", "1", "--outer-lr", "0.5")
    line = _failure(capsys, argv)
    assert f"checkpoint in {checkpoint} belongs to a different run or model configuration" in line
    assert "(outer_lr: checkpoint 0.7, yours 0.5)" in line
    assert "pass --outer-lr 0.7 to resume it, or another --checkpoint-dir" in line
