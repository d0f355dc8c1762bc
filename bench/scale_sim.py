"""Learner groups at 8 to 1000 nodes, simulated: bytes per node, DHT reads, one applied set.

    python -m bench.scale --sim --nodes 8,64,1000

A virtual clock and network run the real decision classes of issue 22: dht.grouping (who is in
which group, each epoch), dht.shards (heartbeat shards, split and merged as peers come and
go), merge.group_update (each group's fault-tolerant reduction, with real Ed25519 signatures
and co-signatures, verified before any replica applies the update), dht.catchup (what each
group fetches, from which live holder, what is lost) and the project's own merge.weighting,
merge.robust and merge.outer on small tensors (a noisy quadratic the swarm descends).
Churn: joins, kill -9 (before the deadline or while reducing) and freezes; every link has
its own bandwidth. Bytes are counted from the simulated messages, sized for the
`tiny` model's real update (its parameter count from node.model, its payload from
merge.codecs' bf16 codec) plus the signed headers; the all-to-all figure of the same rounds
is computed beside them. Simplifications (docs/scale.md): the members of a group share one
replica object (after the all-gather they hold the same state); a group update is verified
once, its verdict being a pure function of its bytes.

Simulation's parts (session 24, methods moved unchanged): the reductions are
bench.scale_sim_reduce.Reducing, publishing, fetching, applying and catch-up
bench.scale_sim_deliver.Delivering; churn, grouping, accounting and the row stay here.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter, defaultdict
from typing import Any

import torch

from bench import scale_sim_wire as wire
from bench.scale_keys import balanced_identities
from bench.scale_sim_deliver import Delivering
from bench.scale_sim_levers import Levers
from bench.scale_sim_reduce import RUN_ID, Reducing
from bench.scale_sim_state import Published, SimConfig, SimNode, SimReplica
from dht.grouping import Grouping, GroupingConfig, GroupingPolicy, MembershipView
from dht.ranges import UpdateId
from dht.shards import ShardConfig, ShardTree
from merge.codecs import get_codec
from merge.identity import Identity
from merge.weighting import TokenWeightConfig

"""Holder records a group keeps per update (its first members): bounded, as in the DHT."""
CODEC = "bf16"
MB = 1e6


class Simulation(Reducing, Delivering, Levers):
    """One swarm of ``nodes`` peers run for the configured rounds."""

    def __init__(self, nodes: int, config: SimConfig, update_bytes: int) -> None:
        self.config, self.update_bytes = config, update_bytes
        self.codec = get_codec(CODEC)
        self.numel = update_bytes // self.codec.payload_bytes(1)
        """Parameters of the model whose bytes are counted (tiny's)."""
        self.rng = random.Random(config.seed * 1_000_003 + nodes)
        self.hostile_rng = random.Random(config.seed * 1_000_003 + nodes + 1)
        grouping = GroupingConfig(min_group_size=config.group_size) if config.group_size else None
        self.policy = GroupingPolicy(RUN_ID, grouping)
        self.shards = ShardTree(RUN_ID, ShardConfig())
        self.optimum = torch.randn(config.dim, generator=torch.Generator().manual_seed(1))
        self.noise = torch.Generator().manual_seed(config.seed * 1_000_003 + nodes)
        self.nodes: list[SimNode] = []
        self.by_id: dict[str, SimNode] = {}
        self.grouping: Grouping | None = None
        self.replicas: dict[str, SimReplica] = {}
        self.published: dict[str, Published] = {}
        self.uids: dict[UpdateId, str] = {}
        """Catch-up's ids, (group key, round), to update ids."""
        self.arrivals: list[tuple[float, int, str, int]] = []
        self.counters: Counter[str] = Counter()
        self.by_kind: defaultdict[str, float] = defaultdict(float)
        """Bytes received by all nodes, by message kind (the row's breakdown)."""
        self.all_to_all_bytes = 0.0
        self.node_rounds = 0
        self._ids: dict[int, SimReplica] = {}
        self._header_bytes = 0.0
        """Mean wire bytes of the contribution headers signed so far."""
        self.token_config = TokenWeightConfig(reference_tokens=config.tokens_per_round)
        genesis = SimReplica.fresh(config.dim)
        self._initial: list[Identity] = []
        if config.balanced:  # as `bench.scale --balanced` starts its real nodes
            size = config.group_size or GroupingConfig().min_group_size
            self._initial = balanced_identities(
                RUN_ID,
                nodes,
                size,
                lambda: Identity.from_private_bytes(self.hostile_rng.randbytes(32)),
            )[::-1]
        for _ in range(nodes):
            self._join(genesis, 0.0)

    # -- churn ------------------------------------------------------------------------------

    def _join(self, replica: SimReplica, now: float) -> SimNode:
        identity = (
            self._initial.pop()
            if self._initial
            else Identity.from_private_bytes(self.hostile_rng.randbytes(32))  # seeded ids
        )
        node = SimNode(identity, self.rng.uniform(12.5e6, 125e6), replica, now)
        node.dishonest = self.hostile_rng.random() < self.config.dishonest_share
        self.nodes.append(node)
        self.by_id[node.peer_id] = node
        self.shards.add(node.peer_id)
        return node

    def _live(self, now: float) -> list[SimNode]:
        return [n for n in self.nodes if n.alive and not n.frozen(now)]

    def _members(self, now: float) -> dict[int, list[SimNode]]:
        """Live, unfrozen nodes by the replica object they hold."""
        members: dict[int, list[SimNode]] = {}
        for node in self._live(now):
            members.setdefault(id(node.replica), []).append(node)
        return members

    def _churn(self, r: int, now: float) -> dict[str, str]:
        """Draws this round's fates: peer id -> 'killed' or 'frozen' before the deadline, or
        'killed_while_reducing' / 'frozen_while_reducing' after it (then it contributed, and
        is lost to the reduction); newcomers join at the round's start."""
        c, fates = self.config, {}
        for node in [n for n in self.nodes if n.alive and not n.frozen(now)]:
            roll = self.rng.random()
            if roll >= c.kill_rate + c.freeze_rate:
                continue
            fate = "killed" if roll < c.kill_rate else "frozen"
            if self.rng.random() < 0.2:
                fates[node.peer_id] = f"{fate}_while_reducing"
            else:
                fates[node.peer_id] = fate
                self._strike(node, fate, now)
        for _ in range(self._poisson(c.join_rate * len(self._live(now)))):
            self._newcomer(now)
        return fates

    def _poisson(self, mean: float) -> int:
        count, threshold, product = 0, pow(2.718281828459045, -mean), self.rng.random()
        while product > threshold:
            count, product = count + 1, product * self.rng.random()
        return count

    def _strike(self, node: SimNode, fate: str, now: float) -> None:
        if fate.startswith("killed"):
            self._kill(node)
        else:
            self._freeze(node, now, self.rng.choice((1, 2)) * self.config.round_s)

    def _kill(self, node: SimNode) -> None:
        node.alive = False
        self.shards.remove(node.peer_id)  # its heartbeat expires
        self.counters["killed"] += 1

    def _freeze(self, node: SimNode, now: float, duration_s: float) -> None:
        node.frozen_until = now + self.config.round_s + duration_s
        node.switch(node.replica.copy(), now)  # it stops following its group
        self.counters["frozen"] += 1

    def _newcomer(self, now: float) -> None:
        donors = self._live(now)
        if donors:
            node = self._join(self.rng.choice(donors).replica, now)
            self._download_state(node)
            self.counters["joined"] += 1

    def _download_state(self, node: SimNode) -> None:
        """A state transfer: fp32 params and outer momentum of tiny."""
        self._receive(node, "state", 2 * 4 * self.update_bytes / get_codec(CODEC).payload_bytes(1))
        self.counters["state_downloads"] += 1

    # -- groups -----------------------------------------------------------------------------

    def _regroup(self, epoch: int, now: float) -> None:
        view = MembershipView.of(epoch, (n.peer_id for n in self.nodes if n.alive))
        previous = self.grouping.bits if self.grouping else None
        self.grouping = self.policy.decide(view, previous)
        mean_group = max(1, round(len(view.peers) / self.grouping.num_learners))
        self.token_config = TokenWeightConfig(
            reference_tokens=self.config.tokens_per_round * mean_group
        )
        self._attach(now)

    def _attach(self, now: float) -> None:
        """Each group's live members share one replica: the most advanced of theirs; a member
        that held another (a frozen one back, a peer from another group) downloads it."""
        assert self.grouping is not None
        by_id = {n.peer_id: n for n in self.nodes}
        self.replicas = {}
        taken: set[int] = set()
        for key, peers in self.grouping.members.items():
            members = [by_id[p] for p in peers if by_id[p].alive and not by_id[p].frozen(now)]
            if not members:
                continue
            chosen = max(members, key=lambda n: (len(n.replica.applied), n.peer_id)).replica
            # two groups never share a replica object (a split group's halves each copy it)
            replica = chosen.copy() if id(chosen) in taken else chosen
            taken.add(id(replica))
            for node in members:
                if node.replica is not chosen:
                    self._download_state(node)
                node.switch(replica, now)
            self.replicas[key] = replica

    # -- one round --------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        c = self.config
        for r in range(c.rounds + c.linger_rounds):
            now = r * c.round_s
            if r % c.epoch_rounds == 0:
                self._regroup(r // c.epoch_rounds, now)
            else:
                self._attach(now)
            base = {key: len(rep.applied) for key, rep in self.replicas.items()}
            fates = self._churn(r, now) if r < c.rounds else {}
            if r < c.rounds:
                self._account_round(now)
            deadline = now + c.round_s
            self._deliver(deadline)
            if r < c.rounds:
                self._reduce_all(r, base, fates, deadline)
            self._catch_up(deadline)
        self._deliver(float("inf"))
        for replica in self._ids.values():
            self._settle_sums(replica)
        return self._row()

    # -- accounting -------------------------------------------------------------------------

    def _account_round(self, now: float) -> None:
        """Heartbeat reads: the shards covering one's group and a bounded sample, each period;
        the shard directory once per epoch. Then the round's bytes beside its reduction: the
        design's all-gather of the reduced shards, or with `scatter` the shard fetch round."""
        assert self.grouping is not None
        c = self.config
        periods = c.round_s / c.heartbeat_period_s
        leaves = self.shards.leaves()
        directory = len(leaves) if int(now / c.round_s) % c.epoch_rounds == 0 else 0
        by_replica = self._members(now)
        for key, replica in self.replicas.items():
            prefix = key.split("0b", 1)[1]
            group_records = sum(leaves[leaf] for leaf in self.shards.covering(prefix))
            members = by_replica.get(id(replica), [])
            if not members:
                continue
            g = len(members)
            for node in members:
                sample = self.shards.sample(self.rng, c.sample_shards)
                node.records_read += (
                    periods * (group_records + sum(leaves[s] for s in sample)) + directory
                )
                node.live_s += c.round_s
                if not c.wired and not c.scatter:  # the design's all-gather of the round
                    self._receive(node, "all_gather", (g - 1) / g * self.update_bytes)
            if c.scatter and not c.wired:
                self._account_fetch_round(members)
            self.node_rounds += len(members)

    def _account_fetch_round(self, members: list[SimNode]) -> None:
        """A fetch round's messages among a group's g live members, as the real wire sizes
        them (bench.scale_sim_wire): from each other member a proposal, and with K >= 1 other
        groups' updates a part and its slices of the one weighted sum a round gathers (the
        updates past a fold are deferred: `_deferred`); the slices in `_fetch_shards`."""
        assert self.grouping is not None
        g, k = len(members), self.grouping.num_learners - 1
        if g < 2:
            return
        candidates = k + 1 if self.folds_own(k + 1) else k  # the own update folded in
        propose = wire.propose_bytes(candidates, g)
        part = wire.part_bytes(candidates) if k else 0
        for rank, node in enumerate(sorted(members, key=lambda n: n.peer_id)):
            self._receive(node, "propose", (g - 1) * propose)
            self._receive(node, "part", (g - 1) * part)
            if k:
                sizes = [wire.slice_values(self.numel, g, j) for j in range(g) if j != rank]
                sums = sum(wire.sums_bytes(n, 1) - wire.SUMS_WIDTH * n for n in sizes)
                sums += self.config.sums_width * sum(sizes)
                self._receive(node, "sums", sums)

    def _receive(self, node: SimNode, kind: str, num_bytes: float) -> None:
        node.received += num_bytes
        self.by_kind[kind] += num_bytes

    def _row(self) -> dict[str, Any]:
        assert self.grouping is not None
        live = [n for n in self.nodes if n.alive]
        classes = Counter(frozenset(n.replica.applied) for n in live)
        agreement = max(classes.values()) / len(live) if live else 0.0
        everyone = set.intersection(*(set(n.replica.applied) for n in live)) if live else set()
        lost = sum(1 for u in self.published if u not in everyone)
        delays = []
        for update_id in everyone:
            published = self.published[update_id]
            times = [n.had_at(update_id) for n in live if n.joined_at <= published.at]
            delays.append((max(times) - published.deadline) / self.config.round_s)
        received = sum(n.received for n in self.nodes)
        distance = (
            float(torch.linalg.vector_norm(live[0].replica.params - self.optimum))
            / float(torch.linalg.vector_norm(self.optimum))
            if live
            else None
        )
        max_records = max(n.records_read / n.live_s for n in self.nodes if n.live_s)
        return {
            "nodes": len(self.nodes) - self.counters["joined"],
            "learners": self.grouping.num_learners,
            "mb_per_node_per_round": round(received / self.node_rounds / MB, 3),
            "max_dht_records_read_per_node_per_s": round(max_records, 2),
            "agreement": round(agreement, 4),
            "lost": lost,
            "rounds_to_every_replica": round(statistics.mean(delays), 3) if delays else 0.0,
            "relative_distance_to_optimum": None if distance is None else round(distance, 4),
            "all_to_all_mb_per_node_per_round": round(
                self.all_to_all_bytes / self.node_rounds / MB, 3
            ),
            "mb_per_node_per_round_by_kind": {
                kind: round(b / self.node_rounds / MB, 3)
                for kind, b in sorted(self.by_kind.items())
            },
            **{k: v for k, v in sorted(self.counters.items())},
        }


def tiny_update_bytes(codec: str = CODEC) -> int:
    """The payload of one `tiny` update under ``codec``: its real parameter count."""
    from node.model import build_model, model_config

    model = build_model(
        model_config("tiny"), 0
    )  # on CPU: tiny builds in ~0.1 s; meta imports dynamo
    return get_codec(codec).payload_bytes(sum(p.numel() for p in model.parameters()))


def run(sizes: list[int], config: SimConfig | None = None) -> dict[str, Any]:
    """One row per swarm size; the figures of docs/scale.md."""
    config = config or SimConfig()
    update_bytes = tiny_update_bytes()
    rows = [Simulation(n, config, update_bytes).run() for n in sizes]
    return {"model": "tiny", "codec": CODEC, "update_mb": round(update_bytes / MB, 4), "rows": rows}


def parse_sizes(text: str) -> list[int]:
    """--nodes 8,64,1000: one clear sentence for anything else."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--nodes takes comma-separated node counts, got {text!r}.") from None
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"--nodes takes node counts >= 1, got {text!r}.")
    return sizes
