"""One-line causes for what makes p2pd fail, and locks a dead node cannot leave behind."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

import node.settings
from dht.preflight import PreflightError, check_bootstrap_reachable, check_port_free
from node.config import JoinConfig
from node.lifecycle import preflight
from node.locks import InUseError, identity_lock, lock_identity
from tests.conftest import REPO

PEER = "12D3KooWGgtHxHyqJ2bBHB6YPBFu2yC7n1AVXsbuXrBjVt3jxY3E"


def test_a_port_in_use_is_named_with_the_flag_to_change() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PreflightError, match=f"port {port} on 127.0.0.1 is in use.*--port"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again once closed
    check_port_free("127.0.0.1", 0)


def test_the_default_port_taken_moves_to_a_free_one_but_an_explicit_port_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setattr(node.settings, "DEFAULT_PORT", port)  # where the listen port reads it
        assert preflight(JoinConfig(host="127.0.0.1")) == 0  # no --port: any free port
        with pytest.raises(PreflightError, match=f"port {port} on 127.0.0.1 is in use"):
            preflight(JoinConfig(host="127.0.0.1", port=port))  # --port P, even the default
    assert preflight(JoinConfig(host="127.0.0.1")) == port  # free again: the default itself


def test_no_reachable_bootstrap_peer_names_the_address() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, not listening: connections are refused
        maddr = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PEER}"
        with pytest.raises(PreflightError, match=f"no bootstrap peer reachable at {maddr}"):
            check_bootstrap_reachable([maddr], timeout_s=2)


def test_one_reachable_bootstrap_peer_is_enough() -> None:
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))
        up, down = listening.getsockname()[1], closed.getsockname()[1]
        check_bootstrap_reachable(
            [f"/ip4/127.0.0.1/tcp/{down}/p2p/{PEER}", f"/ip4/127.0.0.1/tcp/{up}/p2p/{PEER}"],
            timeout_s=2,
        )
    check_bootstrap_reachable([f"/ip4/127.0.0.1/udp/9/quic-v1/p2p/{PEER}"])  # not probed


def test_a_held_identity_is_refused_and_freed_by_release(tmp_path: Path) -> None:
    key = tmp_path / "identity.key"
    held = identity_lock(key).acquire()
    with pytest.raises(InUseError, match=r"identity .*identity.key is in use.*--identity"):
        identity_lock(key).acquire()
    held.release()
    identity_lock(key).acquire().release()


def test_a_held_default_identity_moves_the_next_node_to_the_first_free_slot(
    tmp_path: Path,
) -> None:
    key = tmp_path / "identity.key"
    first = identity_lock(key).acquire()
    path, second = lock_identity(key, is_default=True)
    assert path == tmp_path / "identity-2.key"
    path3, third = lock_identity(key, is_default=True)
    assert path3 == tmp_path / "identity-3.key"
    second.release()
    again, fourth = lock_identity(key, is_default=True)
    assert again == tmp_path / "identity-2.key"  # the freed slot: same key, same peer id
    for lock in (first, third, fourth):
        lock.release()
    assert lock_identity(key, is_default=True)[0] == key


def test_a_held_explicit_identity_is_refused_not_swapped(tmp_path: Path) -> None:
    key = tmp_path / "mine.key"
    held = identity_lock(key).acquire()
    with pytest.raises(InUseError, match="--identity"):
        lock_identity(key, is_default=False)
    held.release()


def test_a_lock_of_a_killed_process_does_not_block_a_restart(tmp_path: Path) -> None:
    key = tmp_path / "identity.key"
    code = (
        "import sys, os; from pathlib import Path; from node.locks import identity_lock; "
        f"identity_lock(Path({str(key)!r})).acquire(); print('held', flush=True); "
        "os.kill(os.getpid(), 9)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert "held" in done.stdout and done.returncode == -9
    identity_lock(key).acquire().release()
