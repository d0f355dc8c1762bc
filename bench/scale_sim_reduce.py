"""bench.scale_sim's reductions: each group's round reduced (whole, or reduce-scatter with
`SimConfig.scatter`) by the real merge.group_update / merge.group_shards classes, its bytes
counted. A part of :class:`bench.scale_sim.Simulation` (a mixin: the same methods, moved out
of bench/scale_sim.py unchanged in session 24; they read the simulation's state)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable

import torch

from bench.scale_sim_state import SimConfig, SimNode, SimReplica
from dht.grouping import Grouping, GroupingPolicy
from dht.grouping_shards import ReducedShard, piece_frame_bytes, shard_frame_bytes
from merge.codecs import Codec
from merge.group_chunks import aligned_bounds, split
from merge.group_shards import ShardedReduction, sharded_contribution
from merge.group_update import (
    SIGNATURE_BYTES,
    ContributionHeader,
    GroupReduction,
    GroupUpdate,
    Phase,
    RoundFields,
)

RUN_ID = "scale-sim"


class Reducing:
    """Simulation's one-round reductions and their byte accounting."""

    # what it reads of Simulation (bench.scale_sim), which sets or defines each
    config: SimConfig
    codec: Codec
    numel: int
    update_bytes: int
    noise: torch.Generator
    optimum: torch.Tensor
    policy: GroupingPolicy
    grouping: Grouping | None
    nodes: list[SimNode]
    replicas: dict[str, SimReplica]
    counters: Counter[str]
    _receive: Callable[[SimNode, str, float], None]
    all_to_all_bytes: float
    _header_bytes: float
    _live: Callable[[float], list[SimNode]]
    _strike: Callable[[SimNode, str, float], None]
    _publish: Callable[[GroupUpdate, float, list[SimNode]], None]
    _gathered: Callable[[str, str, int, int, int, tuple[str, ...]], None]

    # -- one round's reductions ---------------------------------------------------------

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
            self.codec.payload_bytes(e - s) for s, e in aligned_bounds(self.numel, len(peers))
        ]
        meta: list[int] = []  # each shard's piece frame, the real encoder's (DGP5: a proof)
        header_bytes: list[int] = []
        delivered: set[tuple[str, int, str]] = set()

        def receive(peer: str, num_bytes: float) -> None:
            if by_id[peer].alive:
                self._receive(by_id[peer], "group_round", num_bytes)

        def send_pieces(author: str, included: tuple[str, ...] | None) -> None:
            for shard, reducer in plan.sends(author, included):
                if (author, shard, reducer) not in delivered:
                    delivered.add((author, shard, reducer))
                    receive(reducer, piece_bytes[shard] + meta[shard] + header_bytes[-1])

        def all_gather() -> None:
            included = view.included
            empty = torch.zeros(0)
            signature = b"s" * SIGNATURE_BYTES
            framed = ReducedShard(
                key, fields.epoch, fields.round, included, 0, signature, empty, plan.members
            )
            cosign = shard_frame_bytes(framed, "fp32")  # DGS3: the co-signers as a bitmap
            seal = len(framed.seal_bytes("0" * 64))  # DGS4 (folded): the digest, no values
            for j, reducer in enumerate(view.reducers):
                for member in included:
                    if member != reducer:
                        self._gathered(
                            member, reducer, piece_bytes[j], (cosign, seal), fields.learners,
                            included,
                        )  # fmt: skip

        for node in contributors:
            pseudo_gradient = self._pseudo_gradient(replica)
            if node.dishonest:
                pseudo_gradient = -20 * pseudo_gradient
            header, digests = sharded_contribution(
                pseudo_gradient, node.identity, fields, self.config.tokens_per_round, len(peers)
            )
            view.contribute(header, digests)
            if not meta:
                codec = self.codec.name
                meta.extend(piece_frame_bytes(digests, j, codec) for j in range(len(peers)))
            for j, piece in enumerate(split(pseudo_gradient, len(peers))):
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

    def _account_reduction(self, contributors: list[SimNode], included: int, attempts: int) -> None:
        k = len(contributors)
        if k == 0:
            return
        if self.config.scatter:
            return  # counted message by message (_reduce_sharded)
        parts = (k - 1) if self.config.wired else attempts * (k - 1) / k  # whole or a shard
        for node in contributors:
            self._receive(
                node, "group_round", parts * self.update_bytes + (k - 1) * self._header_bytes
            )
