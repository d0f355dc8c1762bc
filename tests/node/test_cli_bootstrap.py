"""`diloco-node bootstrap --identity`: its key file, its lock, and one line for a bad one.

Every refusal here comes before p2pd starts (tests/swarm/test_bootstrap_restart.py runs one).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from merge.identity import Identity
from node.cli import DEFAULT_BOOTSTRAP_IDENTITY, bootstrap_identity, main
from node.config import DEFAULT_IDENTITY
from node.locks import identity_lock

ANNOUNCE = ["--announce", "/ip4/127.0.0.1/tcp/31337"]


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    return err


def _bootstrap(identity: Path) -> int:
    return main(["bootstrap", *ANNOUNCE, "--identity", str(identity)])


def test_a_corrupt_key_file_is_one_line_and_is_left_as_it_was(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "boot.key"
    key.write_bytes(b"\x08\x01\x12\x40" + b"\x00" * 10)
    key.chmod(0o600)
    assert _bootstrap(key) == 1
    assert f"identity file {key} is not an Ed25519 libp2p key" in _one_line_error(capsys)
    assert key.read_bytes() == b"\x08\x01\x12\x40" + b"\x00" * 10


def test_a_key_path_that_cannot_be_read_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    unreadable = tmp_path / "a-directory"  # root reads any file: a directory it cannot
    unreadable.mkdir()
    assert _bootstrap(unreadable) == 1
    assert f"identity file {unreadable} could not be read" in _one_line_error(capsys)


def test_a_key_other_users_may_read_is_refused_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "boot.key"
    Identity.generate().save(key)
    key.chmod(0o644)
    assert _bootstrap(key) == 1
    assert f"chmod 600 {key}" in _one_line_error(capsys)


def test_a_key_another_process_holds_is_refused_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "boot.key"
    held = identity_lock(key).acquire()  # another bootstrap (or node) running as this key
    try:
        assert _bootstrap(key) == 1
    finally:
        held.release()
    line = _one_line_error(capsys)
    assert f"identity {key} is in use" in line and "--identity PATH" in line
    assert not key.exists()  # refused before it was created


def test_the_default_key_is_bootstrap_key_beside_joins_and_a_held_one_moves_to_a_slot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    default = tmp_path / ".diloco" / "bootstrap.key"
    assert Path(DEFAULT_BOOTSTRAP_IDENTITY).parent == Path(DEFAULT_IDENTITY).parent
    assert Path(DEFAULT_BOOTSTRAP_IDENTITY) != Path(DEFAULT_IDENTITY)

    first_path, first = bootstrap_identity(None)
    assert first_path == default
    second_path, second = bootstrap_identity(None)  # a second bootstrap on this machine
    assert second_path == default.with_name("bootstrap-2.key")
    assert f"this one runs as {second_path}" in capsys.readouterr().err
    second.release()
    first.release()
    again_path, again = bootstrap_identity(None)  # the first, restarted: its own key again
    again.release()
    assert again_path == default


def test_help_names_the_identity_flag_and_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bootstrap", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--identity PATH" in help_text
    assert f"(default: {DEFAULT_BOOTSTRAP_IDENTITY}" in help_text
