"""A known member rejoins through the peers it knew last run when its bootstrap is dead."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dht.known_peers import KNOWN_PEERS_FILE, load_known_peers
from tests.swarm.conftest import NodeProcess
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
    launch: Launch,
) -> None:
    bootstrap = launch(*RUN, name="boot")
    boot_maddr = bootstrap.wait_listening(START_S)[0]
    member = launch(*RUN, "--peers", boot_maddr, name="member")
    returning = launch(*RUN, "--peers", boot_maddr, name="returning")
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
