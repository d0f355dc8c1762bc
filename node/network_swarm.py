"""The network's swarm as the node sees it: `dht.swarm.Swarm` entered in three parts (p2pd,
the DHT's fork, the run check and first heartbeat), the state check and gossip beside
training, learners counted, lingering and leaving.

Importing this module imports hivemind (seconds): the node imports it beside training, once
its first inner step is in (node.swarm_start).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from dht.addresses import join_hint
from dht.group_exchange import GroupExchange
from dht.grouping import member_check
from dht.grouping_follow import follow_s
from dht.heartbeat import Heartbeat, count_learners
from dht.reachability import PathKind
from dht.state_donors import Skipped
from dht.swarm import RunMismatchError, Swarm
from dht.transfer_progress import ProgressReport
from merge.envelope import SignedUpdate
from merge.group_equivocation import variant_digest
from merge.group_update import Abandoned, GroupUpdate
from merge.pipeline import UpdatePipeline
from merge.replica import Replica
from node.events import EventLog
from node.fingerprint import describe_differences, join_arguments
from node.snapshot import PeerSighting
from node.stats import NodeStats
from node.swarm_link import DRAIN_TIMEOUT_S, GroupContribution, peers_finished

logger = logging.getLogger(__name__)
GROUP_ROUND_SLACK_S = 30.0
"""A group round's bound past its deadlines: its last co-signature sends (dht.group_exchange)."""


class NetworkSwarm:
    """The node's side of `dht.swarm.Swarm`: joining, counting learners, lingering, leaving."""

    def __init__(
        self,
        swarm: Swarm,
        *,
        peer_id: str,
        run_id: str,
        run_settings: dict[str, Any],
        replica: Replica,
        pipeline: UpdatePipeline,
        stats: NodeStats,
        events: EventLog,
        replica_changed: Callable[[], None] = lambda: None,
        report_merge: Callable[[Any], None] = lambda _: None,
        groups: bool = False,
    ) -> None:
        """`replica_changed`: sketch the replica anew (node.telemetry), after a realignment;
        `groups`: learner groups are on (the group-part, group-cosign and group-update streams
        are served); `report_merge`: told what became of other groups' updates."""
        self.swarm = swarm
        self._peer_id, self._run_id, self._run_settings = peer_id, run_id, run_settings
        self._replica, self._pipeline = replica, pipeline
        self._stats, self._events = stats, events
        self._catching_up: threading.Thread | None = None
        self._caught_up = threading.Event()
        self._catch_up_error: BaseException | None = None
        self._replica_changed = replica_changed
        swarm.on_realigned = self._realigned
        self._report_merge = report_merge
        self._groups: GroupExchange | None = None
        if groups:
            network, membership = swarm.network, swarm.membership
            self._groups = GroupExchange(
                network,
                numel=replica.numel,
                reject=lambda reason, peer, detail: network._count(reason, peer, detail),
                is_alive=membership.is_alive,
                live_peers=lambda: [h.peer_id for h in membership.alive_peers()],
                on_update=self._group_update,
                retain=swarm.gossip.retain_group,
                on_received=lambda kind, peer, n: events.emit(
                    "group_received", kind=kind, peer_id=peer, megabytes=round(n / 1e6, 4)
                ),
                offer=swarm.gossip.offer_group,
                fetch=swarm.gossip.fetch_group,
                applied_seq=replica.last_seq,
                # --group-shard-fetch: other groups' updates by slices (in the fingerprint)
                shard_fetch=pipeline.groups if run_settings.get("group_shard_fetch") else None,
                fold=bool(run_settings.get("group_fold")),  # --group-fold (in the fingerprint)
                on_event=events.emit,
                on_merged=report_merge,
            )
            swarm.gossip.catchup.held_back = self._groups.held_back
            self._groups.realign = swarm.realign_from_class  # left out of a fetch round's class
            self._groups.applied_variant = self._applied_variant  # notices name their variant
            swarm.gossip.fetcher.assemble = self._groups.assemble  # catch-up by shards (28)

    def _group_update(self, update: GroupUpdate) -> bool:
        """Another group's update (or one of this node's group it was left out of), pushed by
        one of its members: merged as any replica does (merge.pipeline submit_group); True
        when applied (it is then retained and served: dht.gossip_groups)."""
        key = update.head.group_key
        result = self._pipeline.submit_group(update, member_check(self._run_id, key))
        if result.reason == "group_equivocation":  # a valid second variant: its proof goes on
            self.pass_on_evidence(update)
        self._report_merge(result)
        return result.accepted

    def _applied_variant(self, group_key: str, seq: int) -> str | None:
        """The digest of the group variant the replica applied under (group key, seq), or
        None (read on the network's loop: one dict lookup, no lock)."""
        key = self._pipeline.groups.variants.key_of((group_key, seq))
        return None if key is None else variant_digest(key)

    def pass_on_evidence(self, update: GroupUpdate) -> None:
        self.swarm.gossip.evidence.from_thread(self._pipeline.group_evidence(update))

    def contribute(self, contribution: GroupContribution) -> GroupUpdate | Abandoned:
        if self._groups is None:
            raise RuntimeError("learner groups are off (--group-size 0)")
        c = contribution
        run = self._groups.run(
            c.header, c.pseudo_gradient, c.members, wait_s=c.wait_s, cosign_s=c.cosign_s,
            config=c.config, codec=c.codec, payload=c.payload,
        ) if not c.digests else self._groups.run_sharded(
            c.header, c.digests, c.pseudo_gradient, c.members, wait_s=c.wait_s,
            cosign_s=c.cosign_s, config=c.config, codec=c.codec,
        )  # fmt: skip
        timeout_s = c.wait_s + c.cosign_s + follow_s(c.wait_s) + GROUP_ROUND_SLACK_S
        return self.swarm.network.call(run, timeout_s)  # follow_s: dht.grouping_follow

    def group_round(self, group_key: str) -> int:
        return -1 if self._groups is None else self._groups.highest_round.get(group_key, -1)

    def group_senders(self, group_key: str, epoch: int) -> Mapping[str, int]:
        groups = self._groups
        return {} if groups is None else groups.senders.rounds(group_key, epoch)

    def _realigned(self) -> None:
        """The replica took a donor's parameters (dht.realign): its new sketch, then the count,
        which also drops the sketches of its earlier parameters (node.stats)."""
        self._replica_changed()
        self._stats.count_realigned()

    def join(self, joined: Callable[[int], None]) -> None:
        """Enter and catch up, waiting for both, on the calling (main) thread."""
        self.prepare()
        self.fork()
        self.enter()
        self.catch_up(joined)
        self.wait_caught_up(threading.Event())

    def prepare(self) -> None:
        """p2pd (any thread)."""
        self.swarm.start_p2p()

    def fork(self) -> None:
        """The DHT's process: from the main thread, while it holds no lock."""
        self.swarm.fork_dht()

    def enter(self) -> None:
        """Once forked, any thread: the DHT up, the run check, the first heartbeat, then the
        `listening` event."""
        try:
            maddrs = self.swarm.finish_start()
        except RunMismatchError as exc:
            differences = describe_differences(exc.theirs, self._run_settings)
            raise RunMismatchError(
                f"run '{self._run_id}' in this swarm uses a different model or run "
                f"configuration ({differences}); join with the command its nodes print, "
                "or pick another --run-id"
            ) from None
        extra = join_arguments(self._run_settings)
        self._events.emit(
            "listening",
            peer_id=self._peer_id,
            maddrs=maddrs,
            join_command=join_hint(maddrs, extra),
        )
        if self._groups is not None:  # served once the network is up, before any round
            self.swarm.network.call(self._groups.register(), 30.0)
        self.swarm.tell_reachability()

    def catch_up(self, joined: Callable[[int], None]) -> None:
        self._catching_up = threading.Thread(
            target=self._catch_up, args=(joined,), name="catch-up", daemon=True
        )
        self._catching_up.start()

    def _catch_up(self, joined: Callable[[int], None]) -> None:
        try:
            self._download_state()
            joined(self.swarm.announced_seq())
            self._events.emit("startup_phase", name="state_check")  # download, if ahead
            self.swarm.start_gossip()
        except BaseException as exc:  # raised to the training loop by wait_caught_up
            self._catch_up_error = exc
        finally:
            self._caught_up.set()

    def wait_caught_up(self, stop: threading.Event) -> bool:
        while self._catching_up is not None and not self._caught_up.wait(0.2):
            if stop.is_set():
                return False
        return self.caught_up()

    def caught_up(self) -> bool:
        if self._catching_up is None:
            return True
        if not self._caught_up.is_set():
            return False
        if self._catch_up_error is not None:
            raise self._catch_up_error
        return True

    def _download_state(self) -> None:
        stats = self.swarm.download_state()
        if isinstance(stats, Skipped):  # why, with what it saw (dht.state_donors)
            self._events.emit(
                "state_download_skipped",
                reason=stats.reason,
                refusals=stats.refusals,
                waited_s=stats.waited_s,
                line=stats.line,
                **stats.numbers,
            )
            return
        self._events.emit(
            "state_downloaded",
            peer_id=stats.peer_id,
            num_applied=self._replica.num_applied,
            megabytes=round(stats.num_bytes / 1e6, 3),
            seconds=round(stats.seconds, 3),
            mb_per_s=round(stats.mb_per_s, 2),
            unannounced=stats.unannounced,
            # which updates came in with it (bench.chaos counts them merged by this node)
            applied_runs={a: seq_runs(seqs) for a, seqs in self._replica.applied.items()},
            **self._pipeline.window_sizes(),  # what it took over to judge updates by
        )

    def alive_peers(self) -> list[Heartbeat]:
        return self.swarm.alive_peers()

    def live_learners(self) -> int:
        """This node and its alive peers that learn (dht.membership.count_learners)."""
        alive = self.swarm.alive_peers()
        replica = self._replica
        live = 1 + count_learners(alive, lambda peer_id: replica.last_seq(peer_id) >= 1)
        # Peers whose updates are among the last few applied here learn, whether or not the
        # last membership read found them: ~1,000 Sybil heartbeats make reads miss live peers,
        # and a node that sized its updates as a lone learner then took whole outer steps.
        idle = {h.peer_id for h in alive if h.state == "idle"}
        with replica.lock:
            recent = self._pipeline.learner_floor.recent_authors(max(8, 2 * live))
        learning = {h.peer_id for h in alive if replica.last_seq(h.peer_id) >= 1} | recent
        # Fresh keys count as one learner together (merge.learners.credited_learners).
        return 1 + self._pipeline.credited_learners(learning - idle - {self._peer_id})

    def publish(self, update: SignedUpdate) -> bool:
        self.swarm.publish(update)
        return True

    def linger(self, seconds: float, until_done: bool, stop: threading.Event) -> None:
        """Keep serving and merging for `seconds`, so peers still get our last update and we
        get theirs; with `until_done`, only until every live peer has finished, its last
        update is merged here and ours there."""
        if not seconds:
            return
        self._stats.set_state("idle")
        if self._groups is not None:  # no fetch round comes now: other groups' updates whole
            self.swarm.network.call(_stop_holding(self._groups), 10.0)
        self._events.emit("lingering", seconds=seconds)
        started = time.monotonic()
        deadline = started + seconds
        # A peer's heartbeat says idle one period after it published its last update at most.
        settle_s = 2 * self.swarm.config.heartbeat_period_s
        while not stop.wait(min(settle_s, max(deadline - time.monotonic(), 0.0))):
            with self._replica.lock:
                merged = {author: len(seqs) for author, seqs in self._replica.applied.items()}
            own = merged.get(self._peer_id, 0)
            view = self._stats.snapshot().replica
            swarm_done = until_done and peers_finished(
                self.swarm.alive_peers(), self._replica.last_seq, self._peer_id, own, merged,
                (view.applied_digest, view.sketch),
            )  # fmt: skip
            if swarm_done or time.monotonic() >= deadline:
                break
        self._events.emit("lingered", seconds=round(time.monotonic() - started, 2))

    def leave(self) -> None:
        if self._catching_up is not None and not self._caught_up.is_set():
            logger.info("leaving before the state check ended")
        left = self.swarm.drain(DRAIN_TIMEOUT_S)
        if left:
            logger.warning(
                "%d own update(s) still being published after %.0f s; leaving without them",
                left,
                DRAIN_TIMEOUT_S,
            )
        self.swarm.shutdown()
        if self._catching_up is not None:  # ends with the network, if it had not yet
            self._catching_up.join(timeout=DRAIN_TIMEOUT_S)

    def num_lost(self) -> int:
        return self.swarm.num_lost

    def fresh_peers_set_aside(self) -> int:
        return self.swarm.membership.num_fresh_set_aside

    def paths(self) -> dict[PathKind, int]:
        return self.swarm.paths

    def rejections(self) -> dict[str, int]:
        return dict(self.swarm.rejections)

    def visible_maddrs(self) -> list[str]:
        return self.swarm.visible_maddrs

    def state_download(self) -> ProgressReport | None:
        return self.swarm.state_download

    def sightings(self, now: float) -> tuple[PeerSighting, ...]:
        period, at = self.swarm.config.heartbeat_period_s, self.swarm.membership.judged_at()
        return tuple(
            PeerSighting(view.heartbeat, view.alive(period, at), now - view.last_seen)
            for view in list(self.swarm.peers.values())
        )

    def fetched(self) -> tuple[int, int]:
        fetches = list(self.swarm.fetches)
        return len(fetches), sum(f.num_bytes for f in fetches)


async def _stop_holding(groups: GroupExchange) -> None:
    groups.stop_holding()  # on the network's loop, where the exchange's state lives


def seq_runs(seqs: list[int]) -> list[list[int]]:
    """Sorted seqs as inclusive runs [first, last]: [1, 2, 3, 7] -> [[1, 3], [7, 7]]."""
    runs: list[list[int]] = []
    for seq in seqs:
        if runs and seq == runs[-1][1] + 1:
            runs[-1][1] = seq
        else:
            runs.append([seq, seq])
    return runs
