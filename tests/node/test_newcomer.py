"""A newcomer's first hour (issue 24): the command a stranger types, the line they see."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dht.observer import SwarmSnapshot
from node.cli import main
from node.events import _describe
from node.status import print_status

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


@pytest.fixture
def port_8000_taken() -> Iterator[None]:
    """Another program on 8000 (or whoever already holds it on this machine)."""
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", 8000))
        sock.listen()
    except OSError:
        pass  # someone else holds it: taken all the same
    try:
        yield
    finally:
        sock.close()


@pytest.mark.usefixtures("port_8000_taken")
def test_join_serves_its_dashboard_by_default_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_tiny_join(tmp_path, "--max-rounds", "1")) == 0
    err = " ".join(capsys.readouterr().err.split())
    url = re.search(
        r"dashboard: (http://127\.0\.0\.1:(\d+)/) \(no token: open to this machine", err
    )
    assert url is not None, err
    assert url.group(2) != "8000"  # taken: any free port instead
    assert "--no-dashboard for none" in err
    assert "server process" not in err  # uvicorn's own lines stay off the console


def test_no_dashboard_serves_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_tiny_join(tmp_path, "--max-rounds", "1", "--no-dashboard")) == 0
    assert "dashboard:" not in capsys.readouterr().err


def test_the_default_join_on_a_cpu_trains_tiny_and_prints_progress_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [a for a in _tiny_join(tmp_path, "--max-rounds", "1") if a not in ("--model", "tiny")]
    assert main(argv) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "(tiny, " in err and ", cpu)" in err, err  # --model auto, the default, on this CPU
    # output into a file (not a terminal): progress as printed lines, not a live bar
    assert re.search(r"round 1 step 1/2 loss \d+\.\d{4} [\d,]+ tok/s", err), err


def _printed_status(run_id: str | None, summary: str, capsys: pytest.CaptureFixture[str]) -> dict:
    snapshot = SwarmSnapshot(run_id="diloco-default", fingerprint="ab" * 32, run_summary=summary)
    print_status(run_id, [snapshot], as_json=True)
    document: dict = json.loads(capsys.readouterr().out)
    return document


def test_status_json_holds_the_run_config_as_an_object(
    capsys: pytest.CaptureFixture[str],
) -> None:
    document = _printed_status(None, json.dumps({"model": "tiny", "codec": "int8"}), capsys)
    assert "run_id" not in document  # no "run_id": null when none was asked for
    assert document["runs"][0]["config"] == {"model": "tiny", "codec": "int8"}
    assert _printed_status("diloco-default", "{}", capsys)["run_id"] == "diloco-default"


def test_status_json_of_a_peers_unreadable_run_record_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    document = _printed_status(None, "not json", capsys)
    assert document["runs"][0]["config"] == {"unreadable": "not json"}
