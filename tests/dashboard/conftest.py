"""Dashboard tests: an embedded node that trains two tiny rounds, signed heartbeats, a fake DHT.

The swarm harness's fixtures (real node processes, reaped) are re-exported for the browser test.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from dht.heartbeat import Heartbeat
from dht.observer import PeerStatus, SwarmSnapshot
from merge.identity import Identity
from node.config import JoinConfig
from node.events import RecordingEventLog
from node.runtime import Node
from tests.swarm.conftest import (  # noqa: F401  (fixtures used by test_browser.py)
    _no_orphans_leak_into_the_next_test,
    launch,
    swarm_session,
)

SMALL_CORPUS = str(Path(torch.__file__).parent / "functional.py")


def node_config(tmp_path: Path, **overrides: Any) -> JoinConfig:
    base: dict[str, Any] = dict(
        model="tiny",
        data=SMALL_CORPUS,
        inner_steps=2,
        batch_size=2,
        eval_batches=1,
        threads=1,
        identity=str(tmp_path / "id.key"),
        checkpoint_dir=str(tmp_path / "checkpoints"),
        log_format="json",
        swarm=False,
        org="lab",
        dashboard_port=0,
    )
    return JoinConfig(**{**base, **overrides})


@pytest.fixture
def trained_node(tmp_path: Path) -> Iterator[Node]:
    """An offline node with an embedded dashboard (not served) after two rounds."""
    node = Node(node_config(tmp_path), RecordingEventLog())
    node.run_round()
    node.run_round()
    yield node
    assert node.dashboard is not None
    node.dashboard.stop()


@dataclass
class FakeObserver:
    """Stands in for the DHT: returns whatever heartbeats the test put in it."""

    fingerprint: str = "f" * 64
    heartbeats: dict[str, Heartbeat] = field(default_factory=dict)
    failing: bool = False

    def snapshot(self, run_id: str) -> list[SwarmSnapshot]:
        if self.failing:
            raise TimeoutError("the DHT did not answer")
        peers = [PeerStatus(h, 0.0) for h in self.heartbeats.values()]
        return [SwarmSnapshot(run_id, self.fingerprint, "{}", peers)] if peers else []

    def publish(self, heartbeat: Heartbeat, identity: Identity) -> None:
        """As the DHT would hand it out: signed by its peer, then verified."""
        self.heartbeats[heartbeat.peer_id] = Heartbeat.verify(
            heartbeat.sign(identity), heartbeat.peer_id
        )


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
