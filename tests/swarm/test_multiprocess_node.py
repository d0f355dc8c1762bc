"""A node of two processes (torch.distributed, gloo on the CPU) joins a swarm like any other."""

from __future__ import annotations

from pathlib import Path

import pytest

from merge.identity import Identity
from tests.swarm.test_swarm import RUN, Launch, wait_merged
from tests.swarm.together import bootstrap_address, unused_port
from tests.timeouts import EXIT_S, MERGE_S, START_S, covering

pytestmark = [pytest.mark.swarm, pytest.mark.beside]  # light: runs beside the swarm tests


@pytest.mark.timeout(covering(2 * START_S, 3 * MERGE_S, EXIT_S, 5))
def test_a_two_process_node_trains_in_the_swarm_like_any_other(
    launch: Launch, tmp_path: Path
) -> None:
    # Both start at once (tests/swarm/together.py): the pair dials the single node's known
    # address with the product's backoff until it listens.
    key, port = tmp_path / "single.key", unused_port()
    Identity.generate().save(key)
    maddr = bootstrap_address(str(key), port)
    single = launch(*RUN, "--identity", str(key), "--port", str(port), name="single")
    pair = launch(*RUN, "--nproc-per-node", "2", "--peers", maddr, name="pair")
    assert maddr in single.wait_listening(START_S), "single listens where the pair was sent"
    pair.wait_listening(START_S)
    wait_merged(single, pair.peer_id)
    wait_merged(pair, single.peer_id)
    # Its update counts the node's whole batch: 10 inner steps x 16 sequences x 128 bytes.
    done = pair.wait_for_event("round_done", MERGE_S)
    assert done["tokens"] == 10 * 16 * 128
    assert len(pair.of("listening")) == 1, "rank 1 must stay off the swarm"
    assert pair.stop() == 0
    stopped = pair.wait_for_event("stopped", 5)
    assert stopped["reason"] == "interrupted"
    assert pair.of("checkpoint_saved"), pair.stderr_tail()
    assert "Traceback" not in pair.stderr_tail(200), pair.stderr_tail(200)
