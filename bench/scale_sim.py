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
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections import Counter
from typing import Any

import torch

from bench.scale_sim_state import Published, SimConfig, SimNode, SimReplica, catch_up_id
from dht.grouping import Grouping, GroupingPolicy, MembershipView
from dht.ranges import UpdateId
from dht.shards import ShardConfig, ShardTree
from merge.codecs import get_codec
from merge.group_plan import shard_bounds, spread
from merge.group_shards import ShardedReduction, sharded_contribution
from merge.group_update import (
    SIGNATURE_BYTES,
    ContributionHeader,
    GroupReduction,
    GroupUpdate,
    Phase,
    RoundFields,
)
from merge.identity import Identity
from merge.shard_round import overlapping
from merge.weighting import StalenessConfig, TokenWeightConfig, staleness_weight, token_weight

RUN_ID = "scale-sim"
HOLDERS_PER_GROUP = 3
"""Holder records a group keeps per update (its first members): bounded, as in the DHT."""
CODEC = "bf16"
MB = 1e6


class Simulation:
    """One swarm of ``nodes`` peers run for the configured rounds."""

    def __init__(self, nodes: int, config: SimConfig, update_bytes: int) -> None:
        self.config, self.update_bytes = config, update_bytes
        self.codec = get_codec(CODEC)
        self.numel = update_bytes // self.codec.payload_bytes(1)
        """Parameters of the model whose bytes are counted (tiny's)."""
        self.rng = random.Random(config.seed * 1_000_003 + nodes)
        self.hostile_rng = random.Random(config.seed * 1_000_003 + nodes + 1)
        self.policy = GroupingPolicy(RUN_ID)
        self.shards = ShardTree(RUN_ID, ShardConfig())
        self.optimum = torch.randn(config.dim, generator=torch.Generator().manual_seed(1))
        self.noise = torch.Generator().manual_seed(config.seed * 1_000_003 + nodes)
        self.nodes: list[SimNode] = []
        self.grouping: Grouping | None = None
        self.replicas: dict[str, SimReplica] = {}
        self.published: dict[str, Published] = {}
        self.uids: dict[UpdateId, str] = {}
        """Catch-up's ids, (group key, round), to update ids."""
        self.arrivals: list[tuple[float, int, str, int]] = []
        self.counters: Counter[str] = Counter()
        self.all_to_all_bytes = 0.0
        self.node_rounds = 0
        self._ids: dict[int, SimReplica] = {}
        self._header_bytes = 0.0
        """Mean wire bytes of the contribution headers signed so far."""
        self.token_config = TokenWeightConfig(reference_tokens=config.tokens_per_round)
        genesis = SimReplica.fresh(config.dim)
        for _ in range(nodes):
            self._join(genesis, 0.0)

    # -- churn ------------------------------------------------------------------------------

    def _join(self, replica: SimReplica, now: float) -> SimNode:
        identity = Identity.from_private_bytes(self.hostile_rng.randbytes(32))  # seeded ids
        node = SimNode(identity, self.rng.uniform(12.5e6, 125e6), replica, now)
        node.dishonest = self.hostile_rng.random() < self.config.dishonest_share
        self.nodes.append(node)
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
        node.received += 2 * 4 * self.update_bytes / get_codec(CODEC).payload_bytes(1)
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
        return self._row()

    def _reduce_all(
        self, r: int, base: dict[str, int], fates: dict[str, str], deadline: float
    ) -> None:
        assert self.grouping is not None
        by_id = {n.peer_id: n for n in self.nodes}
        num_live, num_contributions = len(self._live(deadline - self.config.round_s)), 0
        for key, peers in self.grouping.members.items():
            replica = self.replicas.get(key)
            if replica is None:
                continue
            fields = RoundFields(
                run_id=RUN_ID,
                group_key=key,
                epoch=self.grouping.epoch,
                round=r,
                learners=self.grouping.num_learners,
                base_applied=base.get(key, 0),
                published_applied=len(replica.applied),
            )
            contributors = [
                by_id[p] for p in peers if by_id[p].alive and by_id[p].replica is replica
            ]
            num_contributions += len(contributors)
            update = self._reduce(key, peers, fields, contributors, fates, replica)
            if update is not None:
                self._publish(update, deadline, contributors)
        self.all_to_all_bytes += (
            num_contributions * max(num_live - 1, 0) * (self.update_bytes + self._header_bytes)
        )

    def _reduce(
        self,
        key: str,
        peers: tuple[str, ...],
        fields: RoundFields,
        contributors: list[SimNode],
        fates: dict[str, str],
        replica: SimReplica,
    ) -> GroupUpdate | None:
        if self.config.scatter:
            return self._reduce_sharded(key, peers, fields, contributors, fates, replica)
        reduction = GroupReduction(
            group_key=key,
            epoch=fields.epoch,
            round=fields.round,
            members=peers,
            config=self.config.reduction,
        )
        header_bytes = []
        for node in contributors:
            pseudo_gradient = self._pseudo_gradient(replica)
            if node.dishonest:
                pseudo_gradient = -20 * pseudo_gradient
            header = ContributionHeader.of(
                pseudo_gradient, node.identity, fields, self.config.tokens_per_round
            )
            reduction.contribute(header, pseudo_gradient)
            header_bytes.append(header.wire_bytes())
        self._header_bytes = statistics.mean(header_bytes) if header_bytes else self._header_bytes
        reduction.close()
        attempts = 1
        for node in contributors:
            fate = fates.get(node.peer_id, "")
            if fate.endswith("_while_reducing"):
                before = reduction.retries
                reduction.lose(node.peer_id)
                attempts += reduction.retries - before
                self._strike(node, fate, fields.round * self.config.round_s)
        for member in reduction.included if reduction.phase is Phase.REDUCING else ():
            signer = next(n for n in contributors if n.peer_id == member).identity
            reduction.cosign(member, signer.sign(reduction.statement(member)))
        self._account_reduction(
            contributors, len(reduction.included) or len(contributors), attempts
        )
        outcome = reduction.outcome
        if not isinstance(outcome, GroupUpdate):
            self.counters["abandoned"] += 1
            return None
        prefix = key.split("0b", 1)[1]
        problem = outcome.problem(lambda p: self.policy.prefix_of(p, len(prefix)) == prefix)
        if problem is not None:
            self.counters[f"rejected_{problem}"] += 1
            return None
        return outcome

    def _reduce_sharded(
        self,
        key: str,
        peers: tuple[str, ...],
        fields: RoundFields,
        contributors: list[SimNode],
        fates: dict[str, str],
        replica: SimReplica,
    ) -> GroupUpdate | None:
        """The round by reduce-scatter (merge.group_shards), every message's bytes counted at
        its receiver: pieces to their shards' members, re-sends to the reducers of shards
        whose member is not included, reduced shards with co-signatures to every included
        member (once per attempt: an attempt lost to a dying reducer costs its all-gather)."""
        view = ShardedReduction(
            group_key=key,
            epoch=fields.epoch,
            round=fields.round,
            members=peers,
            numel=self.config.dim,
            config=self.config.reduction,
        )
        plan, by_id = view.plan, {n.peer_id: n for n in self.nodes}
        piece_bytes = [
            self.codec.payload_bytes(e - s) for s, e in shard_bounds(self.numel, len(peers))
        ]
        meta = 16 + 65 * plan.num_shards
        header_bytes: list[int] = []
        delivered: set[tuple[str, int, str]] = set()

        def receive(peer: str, num_bytes: float) -> None:
            if by_id[peer].alive:
                by_id[peer].received += num_bytes

        def send_pieces(author: str, included: tuple[str, ...] | None) -> None:
            for shard, reducer in plan.sends(author, included):
                if (author, shard, reducer) not in delivered:
                    delivered.add((author, shard, reducer))
                    receive(reducer, piece_bytes[shard] + meta + header_bytes[-1])

        def all_gather() -> None:
            included = view.included
            cosign = SIGNATURE_BYTES + 64 + sum(len(m) + 3 for m in included)
            for j, reducer in enumerate(view.reducers):
                for member in included:
                    if member != reducer:
                        receive(member, piece_bytes[j] + cosign)

        for node in contributors:
            pseudo_gradient = self._pseudo_gradient(replica)
            if node.dishonest:
                pseudo_gradient = -20 * pseudo_gradient
            header, digests = sharded_contribution(
                pseudo_gradient, node.identity, fields, self.config.tokens_per_round, len(peers)
            )
            view.contribute(header, digests)
            for j, piece in enumerate(torch.tensor_split(pseudo_gradient, len(peers))):
                view.take_piece(node.peer_id, j, piece)
            header_bytes.append(header.wire_bytes())
            send_pieces(node.peer_id, None)
        self._header_bytes = statistics.mean(header_bytes) if header_bytes else self._header_bytes
        view.close()
        for author in view.included:
            send_pieces(author, view.included)
        for node in contributors:
            fate = fates.get(node.peer_id, "")
            if fate.endswith("_while_reducing") and view.phase is Phase.REDUCING:
                all_gather()  # the attempt's shards went out (an upper bound), then it died
                view.lose(node.peer_id)
                self._strike(node, fate, fields.round * self.config.round_s)
                for author in view.included if view.phase is Phase.REDUCING else ():
                    send_pieces(author, view.included)
            elif fate.endswith("_while_reducing"):
                self._strike(node, fate, fields.round * self.config.round_s)
        if view.phase is Phase.REDUCING:
            all_gather()
            for j, reducer in enumerate(view.reducers):
                shard = view.reduce(j)
                view.take_reduced(j, shard, by_id[reducer].identity.sign(view.statement(j, shard)))
        outcome = view.outcome
        if not isinstance(outcome, GroupUpdate):
            self.counters["abandoned"] += 1
            return None
        prefix = key.split("0b", 1)[1]
        problem = outcome.problem(lambda p: self.policy.prefix_of(p, len(prefix)) == prefix)
        if problem is not None:
            self.counters[f"rejected_{problem}"] += 1
            return None
        return outcome

    def _pseudo_gradient(self, replica: SimReplica) -> torch.Tensor:
        """theta_base - theta_local after H inner steps on a noisy quadratic."""
        noise = torch.randn(self.config.dim, generator=self.noise)
        return 0.05 * (replica.params - self.optimum) + 0.02 * noise

    def _publish(self, update: GroupUpdate, deadline: float, contributors: list[SimNode]) -> None:
        k = len(update.contributions)
        slowest = min(n.down_bps for n in contributors)
        at = deadline + 2 * (k - 1) / k * self.update_bytes / slowest + 2 * self.config.latency_s
        self.published[update.update_id] = Published(update, at, deadline, update.header_bytes())
        self.counters["published"] += 1
        members, alive = self._members(at), self._alive_ids(at)
        uid = catch_up_id(update)
        self.uids[uid] = update.update_id
        included = [h.author for h in update.contributions]
        for key, replica in self.replicas.items():
            here = members.get(id(replica), [])
            if key == update.head.group_key:  # its own group holds it once reduced
                self._schedule(replica, update.update_id, at, key, here)
                continue
            replica.catch_up.announced(*uid, None, at, holder=included[0])
            replica.catch_up.holders(*uid, included, at)
            self._fetch(replica, key, at, here, alive)

    def _alive_ids(self, now: float) -> set[str]:
        return {n.peer_id for n in self._live(now)}

    def _fetch(
        self, replica: SimReplica, key: str, now: float, members: list[SimNode], alive: set[str]
    ) -> None:
        """Starts the fetches the replica's catch-up decides on."""
        for fetch in replica.catch_up.next_fetches(now, alive):
            self._schedule(replica, self.uids[fetch.update_id], now, key, members)

    def _schedule(
        self, replica: SimReplica, update_id: str, now: float, key: str, members: list[SimNode]
    ) -> None:
        """The group fetches the update split over its live members, then all-gathers it."""
        if update_id in replica.applied or update_id in replica.inflight:
            return
        if not members:
            return
        published = self.published[update_id]
        own = published.update.head.group_key == key
        g = len(members)
        if not own and self.config.scatter and not self.config.wired:
            self._fetch_shards(published.update, members, published.header_bytes)
        elif not own:
            share = self.update_bytes if self.config.wired else self.update_bytes / g
            for node in members:
                node.received += share + published.header_bytes
        slowest = min(n.down_bps for n in members)
        delay = (
            0.0 if own else self.config.latency_s + (2 * g - 1) / g * self.update_bytes / slowest
        )
        replica.inflight.add(update_id)
        self._ids[id(replica)] = replica
        heapq.heappush(self.arrivals, (now + delay, len(self.arrivals), update_id, id(replica)))

    def _fetch_shards(self, update: GroupUpdate, members: list[SimNode], header_bytes: int) -> None:
        """Each live member fetches its shards of another group's update (its signed headers
        with them, to check the shards' co-signatures), split as its members split it."""
        shards = len(update.members) or len(update.contributions)
        sizes = [self.codec.payload_bytes(e - s) for s, e in shard_bounds(self.numel, shards)]
        by_id = {n.peer_id: n for n in members}
        for node in members:
            node.received += header_bytes
        if self.config.shard_round_sums and not self.config.shard_round_aligned:
            bounds = shard_bounds(self.numel, shards)
            ranked = sorted(by_id)
            for (start, end), peer in zip(
                shard_bounds(self.numel, len(ranked)), ranked, strict=True
            ):
                by_id[peer].received += sum(sizes[k] for k in overlapping(bounds, start, end))
            return
        for k, fetcher in enumerate(spread(shards, by_id)):
            by_id[fetcher].received += sizes[k]

    def _deliver(self, until: float) -> None:
        while self.arrivals and self.arrivals[0][0] <= until:
            at, _, update_id, replica_id = heapq.heappop(self.arrivals)
            replica = self._ids[replica_id]
            replica.inflight.discard(update_id)
            update = self.published[update_id].update
            if update_id not in replica.applied:
                self._apply(replica, update, at)
            replica.catch_up.fetched(catch_up_id(update))

    def _apply(self, replica: SimReplica, update: GroupUpdate, at: float) -> None:
        """The project's weighting, robust checks and outer step, as a replica runs them."""
        head = update.head
        staleness = max(0, head.published_applied - head.base_applied)
        weight = staleness_weight(StalenessConfig(), staleness, head.learners) * token_weight(
            self.token_config, update.tokens
        )
        pseudo_gradient = update.aggregate
        verdict = replica.robust.judge(pseudo_gradient, replica.outer.momentum_parts())
        if verdict.reason == "against_momentum":
            weight = 0.0
        elif verdict.reason == "norm_outlier" and verdict.median_norm is not None:
            bound = replica.robust.config.max_norm_to_median * verdict.median_norm
            pseudo_gradient = pseudo_gradient * (bound / verdict.norm)
        replica.robust.record(verdict)
        if verdict.reason is not None:
            self.counters[f"robust_{verdict.reason}"] += 1
        if weight:
            replica.outer.step(replica.params, pseudo_gradient, weight, head.learners)
        replica.applied[update.update_id] = at
        replica.applied_ids.add(catch_up_id(update))

    def _catch_up(self, now: float) -> None:
        """Anti-entropy through dht.catchup: each group hears every published update and its
        live holders (a bounded few per group), fetches what it lacks, counts what is lost."""
        members, alive = self._members(now), self._alive_ids(now)
        holders: dict[UpdateId, list[str]] = {}
        for replica in {id(r): r for r in self.replicas.values()}.values():
            first = [n.peer_id for n in members.get(id(replica), [])[:HOLDERS_PER_GROUP]]
            for uid in replica.applied_ids:
                holders.setdefault(uid, []).extend(first)
        for key, replica in self.replicas.items():
            catch_up = replica.catch_up
            for uid in self.uids:
                if not catch_up.knows(uid):
                    catch_up.announced(*uid, None, now, holder=(holders.get(uid) or [uid[0]])[0])
                if uid in holders and not replica.has_applied(*uid):
                    catch_up.holders(*uid, holders[uid], now)
            self._fetch(replica, key, now, members.get(id(replica), []), alive)
            self.counters["declared_lost"] += len(catch_up.declare_lost(now, alive))

    # -- accounting -------------------------------------------------------------------------

    def _account_round(self, now: float) -> None:
        """Heartbeat reads: the shards covering one's group and a bounded sample, each period;
        the shard directory once per epoch. And one all-gather of the round's reduced shards."""
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
            for node in members:
                sample = self.shards.sample(self.rng, c.sample_shards)
                node.records_read += (
                    periods * (group_records + sum(leaves[s] for s in sample)) + directory
                )
                node.live_s += c.round_s
                # the all-gather of the reduced shards (design) or, with scatter, of the
                # weighted incoming shards (the own group's are counted as they are sent)
                if not c.wired and not (c.scatter and self.grouping.num_learners == 1):
                    node.received += (len(members) - 1) / len(members) * self.update_bytes
                    node.received += self._shard_round_bytes(len(members))
            self.node_rounds += len(members)

    def _shard_round_bytes(self, g: int) -> float:
        """What session 16's linear merge adds per member a round (SimConfig
        `shard_round_sums`): the other members' part Gram matrices, and the weighted sums
        beyond the first."""
        c = self.config
        assert self.grouping is not None
        if not (c.scatter and c.shard_round_sums) or c.wired:
            return 0.0
        basis = 3 + self.grouping.num_learners - 1  # params, momentum, round sum; incoming
        gram = 8 * basis * (basis + 1) / 2 + SIGNATURE_BYTES
        extra_sums = (c.shard_round_sums - 1) * (g - 1) / g * self.update_bytes
        return (g - 1) * gram + extra_sums

    def _account_reduction(self, contributors: list[SimNode], included: int, attempts: int) -> None:
        k = len(contributors)
        if k == 0:
            return
        if self.config.scatter:
            return  # counted message by message (_reduce_sharded)
        parts = (k - 1) if self.config.wired else attempts * (k - 1) / k  # whole or a shard
        for node in contributors:
            node.received += parts * self.update_bytes + (k - 1) * self._header_bytes

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
