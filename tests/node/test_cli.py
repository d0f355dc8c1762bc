"""The CLI's promises: clear one-line errors, no tracebacks, a version, a keygen."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from node.cli import main
from tests.conftest import REPO, run_cli

# A real text file of a few hundred KB that every machine with torch has.
SMALL_CORPUS = str(Path(torch.__file__).parent / "functional.py")


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["join", "--inner-steps", "zero"], "invalid int value"),
        (["join", "--inner-steps", "0"], "--inner-steps must be a positive integer"),
        (["join", "--model", "huge"], "--model must be one of auto, tiny, small, base"),
        (["join", "--outer-lr", "nan"], "invalid float value"),
        (["join", "--no-such-flag"], "unrecognized arguments"),
        (["join", "--codec", "int3"], "--codec must be one of"),
    ],
)
def test_bad_flags_give_one_clear_line(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc_info:
        code = main(argv)
        raise SystemExit(code)
    assert exc_info.value.code != 0
    assert expected in _one_line_error(capsys)


def _join(tmp_path: Path, *extra: str) -> list[str]:
    return [
        "join",
        "--model", "tiny",
        "--identity", str(tmp_path / "id.key"),
        "--checkpoint-dir", str(tmp_path / "ckpt"),
        "--max-rounds", "1",
        "--inner-steps", "2",
        "--log-format", "json",
        "--no-swarm",
        *extra,
    ]  # fmt: skip


def test_missing_data_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(_join(tmp_path, "--data", str(tmp_path / "nope.txt"))) != 0
    assert "nope.txt" in _one_line_error(capsys)


def test_unreadable_data_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() == 0:
        # root reads anything; a directory without text is the unreadable case it still meets
        empty = tmp_path / "empty"
        empty.mkdir()
        assert main(_join(tmp_path, "--data", str(empty))) != 0
        assert "empty" in _one_line_error(capsys)
        return
    data = tmp_path / "secret.txt"
    data.write_text("x" * 100_000)
    data.chmod(0)
    assert main(_join(tmp_path, "--data", str(data))) != 0
    assert "secret.txt" in _one_line_error(capsys)


def test_bad_key_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "id.key").write_bytes(b"not a key")
    assert main(_join(tmp_path)) != 0
    assert "id.key" in _one_line_error(capsys)


def test_corrupt_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "checkpoint.pt").write_bytes(b"\x80garbage" * 100)
    assert main(_join(tmp_path, "--data", SMALL_CORPUS)) != 0
    assert "checkpoint" in _one_line_error(capsys)


def test_checkpoint_of_another_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(_join(tmp_path, "--data", SMALL_CORPUS)) == 0
    capsys.readouterr()
    assert main(_join(tmp_path, "--data", SMALL_CORPUS, "--seed", "7")) != 0
    assert "different run" in _one_line_error(capsys)


def test_keygen_writes_private_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key = tmp_path / "keys" / "node.key"
    assert main(["keygen", "--identity", str(key)]) == 0
    assert "12D3KooW" in capsys.readouterr().out
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert main(["keygen", "--identity", str(key)]) != 0
    assert "--force" in _one_line_error(capsys)


def test_help_lists_every_flag_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        main(["join", "--help"])
    assert exc_info.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--inner-steps", "--peers", "--no-relay", "--checkpoint-dir", "--log-format"):
        assert flag in out
    assert "[default: 100]" in out


def test_help_version_and_a_bad_flag_answer_without_importing_torch() -> None:
    """torch takes seconds to import (tens on a loaded machine): the parser, the settings and
    their checks load without it, and only a command that trains or reads a model imports it."""
    script = """
import sys
from node.cli import main
for argv in (["--version"], ["join", "--help"], ["join", "--max-rounds", "-1"]):
    try:
        main(argv)
    except SystemExit:
        pass
print(sorted(m for m in ("torch", "hivemind", "fastapi") if m in sys.modules))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "[]"
    assert "--max-rounds must be a positive integer" in done.stderr


def test_console_script_version_and_help(node_home: Path) -> None:
    code, _, _ = run_cli(["--version"], home=node_home, timeout_s=60)
    assert code == 0
    code, _, err = run_cli(["join", "--max-rounds", "-1"], home=node_home, timeout_s=60)
    assert code != 0 and "Traceback" not in err


def test_ctrl_c_while_the_cli_is_still_importing_is_one_line(node_home: Path) -> None:
    """torch takes seconds to import; Ctrl+C then ends the command like Ctrl+C later does."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from node.entry import main; sys.exit(main())",
         "join", "--model", "tiny"],
        cwd=REPO,
        env={**os.environ, "HOME": str(node_home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    # Once torch's library is mapped the child is inside `import torch`, within the entry
    # point's reach (the interpreter's own start, site.py included, is not).
    deadline = time.monotonic() + 60
    while not any("libtorch" in m.path for m in psutil.Process(proc.pid).memory_maps()):
        assert proc.poll() is None and time.monotonic() < deadline, "torch never loaded"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip() == "diloco-node: interrupted"


SWALLOWING_IMPORT = """
import builtins, os, signal, sys, time
watched = sys.argv.pop(1)  # the module whose import the Ctrl+C lands in
real_import = builtins.__import__
def swallowing(name, *args, **kwargs):
    if name == watched and not getattr(builtins, "swallowed", False):
        builtins.swallowed = True
        try:  # a library's bare except around part of an import, as Ctrl+C lands in it
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except:  # noqa: E722
            pass
    return real_import(name, *args, **kwargs)
builtins.__import__ = swallowing
from node.entry import main
sys.exit(main())
"""


# node.cli: the CLI's own imports (no torch); node.app: the node's, which join imports (torch)
@pytest.mark.parametrize("module", ["node.cli", "node.app"])
def test_ctrl_c_swallowed_by_an_import_still_ends_the_command(node_home: Path, module: str) -> None:
    """Ctrl+C during the CLI's or the node's imports inside a library's bare `except:` still
    ends the command in one line (a KeyboardInterrupt raised there was swallowed, and the node
    trained on: 1 of 40 Ctrl+C's at random times of the start, in importlib's module-lock
    callback)."""
    done = subprocess.run(
        [sys.executable, "-c", SWALLOWING_IMPORT, module, "join", "--model", "tiny", "--no-swarm",
         "--no-dashboard", "--max-rounds", "1", "--inner-steps", "1"],
        cwd=REPO,
        env={**os.environ, "HOME": str(node_home)},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stderr.strip() == "diloco-node: interrupted"
