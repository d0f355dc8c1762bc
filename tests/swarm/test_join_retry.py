"""A known member rejoins through the peers it knew last run when its bootstrap is dead."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from dht.known_peers import KNOWN_PEERS_FILE, load_known_peers
from merge.identity import Identity
from tests.swarm.conftest import NodeProcess
from tests.swarm.together import bootstrap_address, unused_port
from tests.timeouts import EXIT_S, START_S, covering

pytestmark = pytest.mark.swarm
Launch = Callable[..., NodeProcess]
RUN = ["--model", "tiny", "--threads", "1", "--inner-steps", "5", "--eval-batches", "0",
       "--heartbeat-period", "1"]  # fmt: skip


def wait_peers_alive(node: NodeProcess, count: int, timeout_s: float) -> None:
    node.wait_for(
        lambda e: e.get("event") == "round_done" and e["peers_alive"] >= count,
        timeout_s,
        f"{node.name} finishing a round with {count} peers alive",
    )


@pytest.mark.timeout(covering(5 * START_S, EXIT_S))  # EXIT_S: the clean stop
def test_a_restarted_node_joins_through_known_peers_after_its_bootstrap_died(
    launch: Launch, tmp_path: Path
) -> None:
    # All three start at once (tests/swarm/together.py): the bootstrap's address is known
    # before it listens, and the two others dial it with the product's backoff until it does.
    key, port = _identity(tmp_path / "boot.key"), unused_port()
    boot_maddr = bootstrap_address(str(key), port)
    bootstrap = launch(*RUN, "--identity", str(key), "--port", str(port), name="boot")
    member = launch(*RUN, "--peers", boot_maddr, name="member")
    returning = launch(*RUN, "--peers", boot_maddr, name="returning")
    assert boot_maddr in bootstrap.wait_listening(START_S)
    member.wait_listening(START_S)
    wait_peers_alive(returning, 2, START_S)

    returning.stop()  # a clean stop saves the checkpoint and, beside it, the peers it knew
    (known_file,) = returning.home.glob(f".diloco/checkpoints/*/*/{KNOWN_PEERS_FILE}")
    assert any(member.peer_id in m for m in load_known_peers(known_file))
    bootstrap.crash()

    again = launch(*RUN, "--peers", boot_maddr, name="returning")  # same home: same identity
    again.wait_listening(START_S)
    wait_peers_alive(again, 1, START_S)
    assert again.peer_id == returning.peer_id


@pytest.mark.timeout(covering(7 * START_S, EXIT_S))  # EXIT_S: the clean stop
def test_a_known_member_whose_peers_are_all_down_trains_alone_and_rejoins_when_one_returns(
    launch: Launch, tmp_path: Path
) -> None:
    """Its only peer is down: it trains on its checkpoint at once (no exit, no minute of
    retries), dials in the background, and merges the peer's updates once it is back."""
    # Both start at once: the peer's address is known before it listens (together.py).
    key, port = _identity(tmp_path / "peer.key"), unused_port()
    peer_maddr = bootstrap_address(str(key), port)
    peer = launch(*RUN, "--identity", str(key), "--port", str(port), name="peer")
    member = launch(*RUN, "--peers", peer_maddr, name="member")
    assert peer_maddr in peer.wait_listening(START_S)
    wait_peers_alive(member, 1, START_S)
    member.stop()  # its checkpoint: a known member now
    peer.crash()

    again = launch(*RUN, "--peers", peer_maddr, name="member")
    wait_training_alone(again)
    back = launch(*RUN, "--identity", str(key), "--port", str(port), name="peer")  # same address
    assert back.wait_listening(START_S)[0] == peer_maddr
    again.wait_for(
        lambda e: e.get("event") == "update_merged" and e["author"] == peer.peer_id,
        START_S,
        "merging the returned peer's update",
    )
    wait_peers_alive(again, 1, START_S)


@pytest.mark.timeout(covering(5 * START_S, EXIT_S))
def test_a_newcomer_whose_bootstrap_dht_stalls_at_its_first_ping_joins_once_it_answers(
    launch: Launch,
) -> None:
    """The bootstrap's p2pd answers (the preflight's probe and p2pd's connect succeed) but its
    DHT's process is frozen: the newcomer's first DHT ping goes unanswered. It used to exit
    at once ("DHTNode bootstrap failed: none of the initial_peers responded to a ping", a
    restart in tests/swarm/test_restart_lost.py whose peers were stalled); now it dials the
    bootstrap again for a bound (dht.bootstrap_newcomer) and joins once the DHT answers."""
    bootstrap = launch(*RUN, name="boot")
    boot_maddr = bootstrap.wait_listening(START_S)[0]
    wait_peers_alive(bootstrap, 0, START_S)  # its first round: its DHT is up and serving
    forks = _forked_children(bootstrap)
    assert forks, "the bootstrap's DHT process"
    for fork in forks:
        fork.suspend()
    try:
        newcomer = launch(*RUN, "--peers", boot_maddr, name="newcomer")
        _wait_stderr(newcomer, "no bootstrap peer's DHT answered a ping", START_S)
    finally:
        for fork in forks:
            fork.resume()
    newcomer.wait_listening(START_S)
    wait_peers_alive(newcomer, 1, START_S)


def _forked_children(node: NodeProcess) -> list[psutil.Process]:
    """The node's forked children (its DHT's process): those whose command line is the node's
    (the others are p2pd and the orphan reaper, `python -m dht.reaper`)."""
    main = psutil.Process(node.pid)
    return [c for c in main.children() if c.cmdline() == main.cmdline()]


def _wait_stderr(node: NodeProcess, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(text in line for line in list(node.stderr)):
        assert node.alive() and time.monotonic() < deadline, node.stderr_tail()
        time.sleep(0.2)


def _identity(path: Path) -> Path:
    Identity.generate().save(path)
    return path


@pytest.mark.lone  # one node at a time: beside the swarm tests
@pytest.mark.timeout(covering(3 * START_S, EXIT_S))
def test_a_known_member_whose_bootstrap_accepts_tcp_but_speaks_no_libp2p_trains_alone(
    launch: Launch,
) -> None:
    """The bootstrap's port answers the preflight's probe but p2pd's handshake fails there (a
    peer killed between the probe and p2pd's start, in bench.chaos): p2pd refuses to start
    with it, so the known member starts p2pd alone and trains instead of exiting."""
    first = launch(*RUN, "--no-swarm", "--max-rounds", "1", name="member")
    assert first.wait_exit(START_S) == 0  # its checkpoint: a known member now
    with socket.socket() as impostor:
        impostor.bind(("127.0.0.1", 0))
        impostor.listen()
        # Hangs up on every connection: p2pd's dial fails at once, not after its handshake
        # timeout; the preflight's probe (a TCP connect) still succeeds.
        threading.Thread(target=_hang_up_on_all, args=(impostor,), daemon=True).start()
        port = impostor.getsockname()[1]
        fake = f"/ip4/127.0.0.1/tcp/{port}/p2p/12D3KooWGgtHxHyqJ2bBHB6YPBFu2yC7n1AVXsbuXrBjVt3jxY3E"
        again = launch(*RUN, "--peers", fake, name="member")
        wait_training_alone(again)
        again.stop()


def _hang_up_on_all(listener: socket.socket) -> None:
    with contextlib.suppress(OSError):  # the listener closed: the test is over
        while True:
            connection, _ = listener.accept()
            connection.close()


def wait_training_alone(node: NodeProcess) -> None:
    """`node` said it found no peer, then took its first batch: it trains alone."""
    node.wait_event("alone", START_S)
    node.wait_for(
        lambda e: e.get("event") == "startup_phase" and e.get("name") == "first_batch",
        START_S,
        "training alone",
    )
