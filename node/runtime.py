"""A node: runs what node.app composed, from resuming its checkpoint to leaving the swarm.

`Node(config, events)` is the entry point the CLI, the tests and the benchmarks use; the
training loop itself is `node.trainer.Trainer`.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from dht.heartbeat import Heartbeat
from merge.pipeline import MergeResult
from node.app import compose
from node.config import JoinConfig
from node.events import EventLog
from node.snapshot import NodeStatus
from node.swarm_start import StartingSwarm

if TYPE_CHECKING:
    from dht.swarm import Swarm

logger = logging.getLogger(__name__)


class Node:
    """One learner with its replica of the global model."""

    def __init__(self, config: JoinConfig, events: EventLog) -> None:
        events.emit("startup_phase", name="imports")  # process start to here: imports, flags
        parts = compose(config, events)
        parts.events.emit("startup_phase", name="build")  # data, model, replica, learner
        self.parts = parts
        self.config, self.events = parts.config, parts.events
        self.identity, self.peer_id = parts.identity, parts.identity.peer_id
        self.checkpoint_dir, self.device, self.corpus = (
            parts.checkpoint_dir,
            parts.device,
            parts.corpus,
        )
        self.spec, self.fingerprint = parts.spec, parts.spec.fingerprint
        self.model_config, self.merge_config = parts.spec.model, parts.spec.merge
        self.replica, self.pipeline, self.learner = parts.replica, parts.pipeline, parts.learner
        self.num_params = parts.replica.numel
        self.stats, self.seq_ledger, self.run_settings = (
            parts.stats,
            parts.seq_ledger,
            parts.run_settings,
        )
        self.dashboard = parts.dashboard
        self.telemetry, self.trainer, self.persistence = (
            parts.telemetry,
            parts.trainer,
            parts.persistence,
        )
        self.sketcher = parts.telemetry.sketcher

    # ---- lifecycle -------------------------------------------------------------------------

    def run(self) -> None:
        parts = self.parts
        if parts.moved_checkpoint is not None:
            moved = str(parts.moved_checkpoint)
            self.events.emit("checkpoint_moved", src=moved, path=str(self.checkpoint_dir))
        self.resume()
        self.events.emit("startup_phase", name="checkpoint_load")
        dashboard = threading.Thread(target=self._start_dashboard, name="dashboard-start")
        try:
            # Beside training, once its first inner step is in: hivemind's imports, p2pd, the
            # DHT (forked between two steps, then the dashboard's threads), the run check, the
            # state check, gossip. The node trains on its checkpoint meanwhile.
            self.trainer.beside_training.append(
                lambda: parts.swarm.begin(self._joined, forked=dashboard.start)
            )
            self.trainer.run()
        finally:
            self.stats.set_state("idle")
            if dashboard.ident is not None:
                dashboard.join()  # bounded by the server's own start timeout
            if self.dashboard is not None:
                self.dashboard.stop()
            parts.swarm.leave()
            self.telemetry.resketcher.stop()
            self.close()

    def resume(self) -> None:
        """Load the last checkpoint, if any, with the round it stopped midway."""
        self.trainer.partial = self.persistence.resume()

    def request_stop(self) -> None:
        self.trainer.stop.set()

    def request_finish(self) -> None:
        """End training after the current round, then linger and leave (SIGUSR1)."""
        self.trainer.finish.set()

    @property
    def swarm(self) -> Swarm | None:
        """The network's swarm once built (None with --no-swarm)."""
        return self.parts.network

    def close(self) -> None:
        """Release the identity and checkpoint dir for another node (run() does it at exit)."""
        self.parts.release()

    def join_swarm(self) -> None:
        """Enter the swarm and catch up, waiting for both (nothing offline): listen, download
        the state, start gossip. `run` does all of it beside training instead."""
        self.parts.swarm.join(self._joined)

    def build_swarm(self) -> Swarm | None:
        """The network's swarm built now, not started (None offline): for tools that hook its
        parts before `join_swarm` (bench.adversary). `run` builds it beside training."""
        swarm = self.parts.swarm
        return swarm.build() if isinstance(swarm, StartingSwarm) else None

    def _joined(self, announced_seq: int) -> None:
        # A node that rejoins with the same identity continues its seq numbers.
        seq = max(
            self.seq, self.replica.last_seq(self.peer_id), announced_seq, self.seq_ledger.last()
        )
        self.stats.set_seq(seq)
        self.stats.set_published_seq(seq)
        self.telemetry.record_replica()
        self.telemetry.resketcher.start()  # after the DHT's fork: no thread of ours may exist then

    def _start_dashboard(self) -> None:
        """Once the swarm's DHT process has forked: no server thread may hold a lock then.
        Its port was found free when it was built; one taken since costs the page, logged."""
        if self.dashboard is None:
            return
        try:
            url = self.dashboard.start()
        except OSError as exc:
            logger.error("the dashboard did not start: %s", exc)
            return
        logger.debug("dashboard at %s", url)
        self.events.emit("dashboard", url=url, access=self.dashboard.access)

    # ---- what the tests, the benchmarks and the dashboard read -------------------------------

    def run_round(self) -> MergeResult | None:
        return self.trainer.run_round()

    def heartbeat(self) -> Heartbeat:
        return self.telemetry.heartbeat()

    def status(self) -> NodeStatus:
        return self.telemetry.status()

    def report_merge(self, result: MergeResult) -> None:
        self.telemetry.report_merge(result)

    def drift(self) -> float | None:
        return self.telemetry.drift()

    def state_dict(self) -> dict[str, Any]:
        return self.persistence.state_dict(self.trainer.partial)

    def save_checkpoint(self) -> None:
        self.persistence.save(self.trainer.partial)

    def evaluate(self) -> float | None:
        return self.trainer.evaluate()

    @property
    def round(self) -> int:
        return self.stats.round

    @round.setter
    def round(self, value: int) -> None:
        self.stats.set_round(value)

    @property
    def seq(self) -> int:
        return self.stats.seq

    @seq.setter
    def seq(self, value: int) -> None:
        self.stats.set_seq(value)

    @property
    def published_seq(self) -> int:
        return self.stats.published_seq

    @published_seq.setter
    def published_seq(self, value: int) -> None:
        self.stats.set_published_seq(value)

    @property
    def state(self) -> str:
        return self.stats.state

    @state.setter
    def state(self, value: str) -> None:
        self.stats.set_state(value)
