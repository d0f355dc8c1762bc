"""A restarted `diloco-node bootstrap` keeps its address: the same peer id at the same port,
after a Ctrl+C and after a kill -9.

Before, it ran p2pd without a key file: every restart had a new peer id, and every
`--peers .../p2p/OLD_ID` that volunteers had configured failed with "wrong peer id".
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.procs import ChildProcess, python_module
from tests.timeouts import EXIT_S, START_S, covering

pytestmark = [pytest.mark.swarm, pytest.mark.beside]  # light: runs beside the swarm tests
SAID = "bootstrap and relay at "
REAPED_S = 15.0
"""dht.reaper's watchdog ends p2pd and the DHT process of a killed bootstrap (~2.5 s idle)."""
SERVE_S = 3.0
"""How long the first bootstrap serves: one stopped at once let its DHT process go even when
that process ignored SIGTERM (below); one that served 3 s did not."""
GONE_S = 5.0
"""Its DHT process and p2pd are stopped before it exits: anything alive this long after is
left behind (a DHT process that ignored SIGTERM lived on for minutes)."""


@pytest.fixture
def children() -> Iterator[list[ChildProcess]]:
    started: list[ChildProcess] = []
    try:
        yield started
    finally:
        for child in started:
            child.reap()


def free_port() -> int:
    """A port free now, for both runs: --announce must name the port the bootstrap listens on,
    and its restart must listen on the same one."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_bootstrap(home: Path, port: int, name: str) -> ChildProcess:
    argv = python_module(
        "node", "bootstrap", "--host", "127.0.0.1", "--port", str(port),
        "--announce", f"/ip4/127.0.0.1/tcp/{port}",
    )  # fmt: skip
    return ChildProcess(name, argv, home=home).start()


def wait_address(child: ChildProcess, timeout_s: float) -> str:
    """The full address the bootstrap prints once serving (stdout, kept with its stderr)."""
    deadline = time.monotonic() + timeout_s
    while True:
        said = [line.split(SAID, 1)[1] for line in list(child.stderr) if SAID in line]
        if said:
            return said[0].split()[0]
        assert child.alive() and time.monotonic() < deadline, child.stderr_tail()
        time.sleep(0.2)


@pytest.mark.timeout(covering(START_S, SERVE_S, EXIT_S, GONE_S, START_S, EXIT_S, REAPED_S, START_S))
def test_a_restarted_bootstrap_has_the_same_address(
    tmp_path: Path, children: list[ChildProcess]
) -> None:
    port = free_port()
    first = start_bootstrap(tmp_path, port, "bootstrap")
    children.append(first)
    address = wait_address(first, START_S)
    assert address.startswith(f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooW"), address

    time.sleep(SERVE_S)
    os.killpg(first.pid, signal.SIGINT)  # Ctrl+C in its terminal: to its whole group
    assert first.wait_exit(EXIT_S) == 0, first.stderr_tail()
    # its DHT process and p2pd go with it (a DHT process forked under the CLI's SIGTERM
    # handler ignored DHT.shutdown's terminate: the bootstrap hung, the DHT lived on holding
    # the key's lock, and a restart took another key)
    assert not first.leftover_processes(timeout_s=GONE_S), first.stderr_tail()

    again = start_bootstrap(tmp_path, port, "bootstrap-again")
    children.append(again)
    assert wait_address(again, START_S) == address, again.stderr_tail()
    key = tmp_path / ".diloco" / "bootstrap.key"
    assert any(f"identity {key} (kept across restarts)" in line for line in again.stderr)

    again.kill()  # kill -9 of the bootstrap alone (the OOM killer): its watchdog reaps the rest
    again.wait_exit(EXIT_S)
    assert not again.leftover_processes(timeout_s=REAPED_S), again.stderr_tail()
    third = start_bootstrap(tmp_path, port, "bootstrap-third")
    children.append(third)
    assert wait_address(third, START_S) == address, third.stderr_tail()
