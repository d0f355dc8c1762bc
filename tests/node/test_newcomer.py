"""A newcomer's first hour (issue 24): the command a stranger types, the line they see."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from node.cli import main
from node.events import _describe

SMALL_CORPUS = str(Path(torch.__file__).parent / "functional.py")


def _error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc_info:
        main(argv)
    assert exc_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_a_forgotten_subcommand_suggests_join(capsys: pytest.CaptureFixture[str]) -> None:
    line = _error_line(capsys, ["--model", "tiny", "--data", "my notes.txt"])
    assert "did you mean 'diloco-node join --model tiny --data 'my notes.txt''?" in line


def test_no_subcommand_at_all_names_join(capsys: pytest.CaptureFixture[str]) -> None:
    assert "'diloco-node join'" in _error_line(capsys, [])


def _tiny_join(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "join", "--model", "tiny", "--data", SMALL_CORPUS,
        "--identity", str(tmp_path / "id.key"), "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--inner-steps", "2", "--no-swarm", *extra,
    ]  # fmt: skip


def test_resuming_after_a_round_says_how_many_rounds_are_done(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_tiny_join(tmp_path, "--max-rounds", "1")) == 0
    capsys.readouterr()
    assert main(_tiny_join(tmp_path, "--max-rounds", "2")) == 0
    err = capsys.readouterr().err
    assert "1 round done, round 2 starts afresh" in " ".join(err.split()), err


def test_resuming_within_a_round_says_which_step_it_continues_after() -> None:
    fields = {"path": "/ckpt", "round": 0, "step": 26, "num_applied": 0}
    line = _describe("resumed", fields)
    assert line == (
        "resumed from /ckpt: 0 rounds done, round 1 continues after its step 26 (0 updates merged)"
    )
