"""The network's swarm, started beside training (issue 23): a restarted node trains on its
checkpoint first and enters the swarm meanwhile.

Before its first inner step a node imports torch, builds its model and loads its checkpoint;
hivemind (seconds of imports), p2pd and the DHT's bootstrap wait until that step is in. Then
`StartingSwarm.begin` builds and prepares the network in a thread (imports, the port, the
bootstrap peers, p2pd); the DHT's process forks on the training thread at the next step
boundary (`step_boundary`, or while the round's end waits for the swarm), where that thread
holds no lock; the run check, the first heartbeat, the state check and gossip follow in the
background. Until the swarm is entered the node answers as a node alone: no peers, nothing
published (a round's end waits for the state check, so nothing is published before it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from dht.heartbeat import Heartbeat
from dht.reachability import PathKind
from dht.transfer_progress import ProgressReport
from merge.envelope import SignedUpdate
from merge.group_update import Abandoned, GroupUpdate
from node.snapshot import PeerSighting
from node.swarm_link import DRAIN_TIMEOUT_S, GroupContribution, OfflineSwarm

if TYPE_CHECKING:  # imports hivemind: built beside training, never imported before
    from dht.swarm import Swarm
    from node.network_swarm import NetworkSwarm

logger = logging.getLogger(__name__)

WAIT_PERIOD_S = 0.2
"""How often a training thread waiting for the swarm looks whether it may fork the DHT."""
PREPARE_TIMEOUT_S = 120.0
"""How long a stopping node waits for a start in progress (imports, the bootstrap's retries,
p2pd) before it stops what that started."""


class StartingSwarm:
    """A SwarmLink whose network is built, prepared and entered beside training."""

    def __init__(self, build: Callable[[], NetworkSwarm]) -> None:
        self._build = build
        """Imports hivemind, checks the port, dials the bootstrap, builds the network."""
        self._offline = OfflineSwarm()
        self._network: NetworkSwarm | None = None
        self._entered: NetworkSwarm | None = None
        """Set once the run check passed and the first heartbeat is out."""
        self._lock = threading.Lock()
        self._left = False
        self._joined: Callable[[int], None] = lambda seq: None
        self._forked: Callable[[], None] = lambda: None
        self._preparing: threading.Thread | None = None
        self._prepared = threading.Event()
        self._fork_done = False
        self._entering: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def network(self) -> Swarm | None:
        """The network's swarm, once built (tests and benchmarks reach into it)."""
        network = self._network
        return None if network is None else network.swarm

    # ---- starting ------------------------------------------------------------------------

    def build(self) -> Swarm:
        """The network's swarm built (hivemind imported, the bootstrap dialled), not started:
        for tools that hook its parts before `join` (bench.adversary)."""
        if self._network is None:
            self._network = self._build()
        return self._network.swarm

    def join(self, joined: Callable[[int], None]) -> None:
        network = self._network or self._build()
        self._network = network
        network.join(joined)
        self._entered = network

    def begin(self, joined: Callable[[int], None], forked: Callable[[], None]) -> None:
        self._joined, self._forked = joined, forked
        self._preparing = threading.Thread(target=self._prepare, name="swarm-start", daemon=True)
        self._preparing.start()

    def _prepare(self) -> None:
        try:
            network = self._network or self._build()
            with self._lock:
                if self._left:
                    return
                self._network = network
            network.prepare()
        except BaseException as exc:  # raised on the training thread at its next step
            self._error = exc
        finally:
            self._prepared.set()

    def step_boundary(self) -> None:
        if self._error is not None:
            raise self._error
        if self._fork_done or not self._prepared.is_set() or self._network is None:
            return
        self._fork_done = True
        self._network.fork()
        self._forked()
        self._entering = threading.Thread(
            target=self._enter, args=(self._network,), name="swarm-enter", daemon=True
        )
        self._entering.start()

    def _enter(self, network: NetworkSwarm) -> None:
        try:
            network.enter()
            network.catch_up(self._joined)
            self._entered = network  # after catch_up: its state check is known to run
        except BaseException as exc:  # raised to the training loop (step or round's end)
            self._error = exc

    def wait_caught_up(self, stop: threading.Event) -> bool:
        if self._preparing is None and self._entered is None:
            return True  # never begun (a round run by hand): nothing to wait for
        while self._entered is None:
            self.step_boundary()  # a round that ended before the fork: fork now
            if stop.wait(WAIT_PERIOD_S):
                return False
        return self._entered.wait_caught_up(stop)

    def caught_up(self) -> bool:
        if self._error is not None:
            raise self._error
        if self._preparing is None and self._entered is None:
            return True  # never begun, as wait_caught_up
        return self._entered is not None and self._entered.caught_up()

    # ---- leaving -------------------------------------------------------------------------

    def leave(self) -> None:
        with self._lock:
            self._left = True
        if self._preparing is not None:
            self._preparing.join(timeout=PREPARE_TIMEOUT_S)
        if self._entering is not None:
            self._entering.join(timeout=DRAIN_TIMEOUT_S)
        if self._network is not None:
            if self._entered is None:
                logger.info("leaving before the swarm was entered")
            self._network.leave()

    # ---- what the loop, the telemetry and the dashboard read: a node alone until built ------

    @property
    def _now(self) -> NetworkSwarm | OfflineSwarm:
        """The network once built: the first heartbeat, sent while entering, carries its
        addresses (nothing is published before the state check, `wait_caught_up`)."""
        return self._network or self._offline

    def alive_peers(self) -> list[Heartbeat]:
        return self._now.alive_peers()

    def live_learners(self) -> int:
        return self._now.live_learners()

    def publish(self, update: SignedUpdate) -> bool:
        return self._now.publish(update)

    def contribute(self, contribution: GroupContribution) -> GroupUpdate | Abandoned:
        return self._now.contribute(contribution)

    def pass_on_evidence(self, update: GroupUpdate) -> None:
        self._now.pass_on_evidence(update)

    def group_round(self, group_key: str) -> int:
        return self._now.group_round(group_key)

    def group_senders(self, group_key: str, epoch: int) -> Mapping[str, int]:
        return self._now.group_senders(group_key, epoch)

    def linger(self, seconds: float, until_done: bool, stop: threading.Event) -> None:
        if seconds and self.wait_caught_up(stop):  # no round ran: serve once entered
            self._now.linger(seconds, until_done, stop)

    def num_lost(self) -> int:
        return self._now.num_lost()

    def num_need_state(self) -> int:
        network = self.network  # dht.Swarm counts them; NetworkSwarm would only pass it on
        return 0 if network is None else network.num_need_state

    def fresh_peers_set_aside(self) -> int:
        return self._now.fresh_peers_set_aside()

    def paths(self) -> dict[PathKind, int]:
        return self._now.paths()

    def rejections(self) -> dict[str, int]:
        return self._now.rejections()

    def visible_maddrs(self) -> list[str]:
        return self._now.visible_maddrs()

    def state_download(self) -> ProgressReport | None:
        return self._now.state_download()

    def sightings(self, now: float) -> tuple[PeerSighting, ...]:
        return self._now.sightings(now)

    def fetched(self) -> tuple[int, int]:
        return self._now.fetched()
