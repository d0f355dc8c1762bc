"""bench.scale_sim's deliveries: a group update published, fetched by each group (split over
its live members, or by shards), applied with the project's weighting, robust checks and
outer step, and caught up through dht.catchup. A part of :class:`bench.scale_sim.Simulation`
(a mixin: the same methods, moved out of bench/scale_sim.py unchanged in session 24; they read
the simulation's state)."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable

from bench import scale_sim_wire as wire
from bench.scale_sim_levers import cut, shard_holders
from bench.scale_sim_state import Published, SimConfig, SimNode, SimReplica, catch_up_id
from dht.ranges import UpdateId
from merge.codecs import Codec
from merge.group_update import GroupUpdate
from merge.weighting import StalenessConfig, TokenWeightConfig, staleness_weight, token_weight

HOLDERS_PER_GROUP = 3


class Delivering:
    """Simulation's publishing, fetching, applying and catch-up."""

    # what it reads of Simulation (bench.scale_sim), which sets or defines each
    config: SimConfig
    codec: Codec
    numel: int
    update_bytes: int
    replicas: dict[str, SimReplica]
    published: dict[str, Published]
    uids: dict[UpdateId, str]
    arrivals: list[tuple[float, int, str, int]]
    counters: Counter[str]
    _receive: Callable[[SimNode, str, float], None]
    token_config: TokenWeightConfig
    _ids: dict[int, SimReplica]
    _live: Callable[[float], list[SimNode]]
    _members: Callable[[float], dict[int, list[SimNode]]]
    folds_own: Callable[[int], bool]
    _from_holders: Callable[[SimNode, Published, int, int, str, float], None]
    _settle_sums: Callable[[SimReplica], None]

    # -- delivery -----------------------------------------------------------------------

    def _publish(self, update: GroupUpdate, deadline: float, contributors: list[SimNode]) -> None:
        k = len(update.contributions)
        slowest = min(n.down_bps for n in contributors)
        at = deadline + 2 * (k - 1) / k * self.update_bytes / slowest + 2 * self.config.latency_s
        holders: tuple[tuple[str, ...], ...] = ()
        meta = 0
        if self.folds_own(update.head.learners):
            holders = shard_holders(update, self.config.fold_own_replicas)
            meta = wire.slice_meta(update)
        self.published[update.update_id] = Published(
            update, at, deadline, update.header_bytes(), holders, meta
        )
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
        if own and published.holders:  # folded: its slice, but for the shards it holds
            for rank, node in enumerate(sorted(members, key=lambda n: n.peer_id)):
                start, end = cut(self.numel, g)[rank]
                self._from_holders(node, published, start, end, "own_slices", now)
        elif not own and self.config.scatter and not self.config.wired:
            self._fetch_shards(published, members, now)
        elif not own:
            share = self.update_bytes if self.config.wired else self.update_bytes / g
            for node in members:
                self._receive(node, "whole_fetch", share + published.header_bytes)
        slowest = min(n.down_bps for n in members)
        delay = (
            0.0 if own else self.config.latency_s + (2 * g - 1) / g * self.update_bytes / slowest
        )
        replica.inflight.add(update_id)
        self._ids[id(replica)] = replica
        heapq.heappush(self.arrivals, (now + delay, len(self.arrivals), update_id, id(replica)))

    def _fetch_shards(self, published: Published, members: list[SimNode], now: float) -> None:
        """Each live member's `group-slice` answer for another group's update, as real nodes
        (--group-shard-fetch) cut it: the update's fields and exactly the member's slice of
        the model (its rank in the sorted live members; the chunk grid since session 27:
        bench.scale_sim_wire). A folded update
        (`fold_own`) is asked of each shard's holders (bench.scale_sim_levers)."""
        update = published.update
        shards = update.num_shards
        meta, g = wire.slice_meta(update), len(members)
        for rank, node in enumerate(sorted(members, key=lambda n: n.peer_id)):
            if published.holders:
                start, end = cut(self.numel, g)[rank]
                self._from_holders(node, published, start, end, "slices", now)
                continue
            payload = wire.slice_payload(self.codec, self.numel, shards, g, rank)
            self._receive(node, "slices", meta + payload)

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
        deferred = self._deferred(replica, update, at)
        if weight:
            folded = replica.outer.step(replica.params, pseudo_gradient, weight, head.learners)
            replica.window_tail |= deferred  # a share after the window's last fold, so far
            window = self._window(replica, update, at)
            if folded is None and window is not None:
                if window != replica.fold_window:
                    self._settle_sums(replica)
                    replica.fold_window = window
                replica.window_folds += 1
                replica.window_tail = False
        replica.applied[update.update_id] = at
        replica.applied_ids.add(catch_up_id(update))

    def _window(self, replica: SimReplica, update: GroupUpdate, at: float) -> int | None:
        """The fetch round an incoming update is applied in (the round window its arrival
        falls in), or None when no shard-fetch round takes it (own, wired, one group)."""
        own = self.replicas.get(update.head.group_key) is replica
        if own and not self.folds_own(update.head.learners):
            return None
        if not self.config.scatter or self.config.wired or update.head.learners < 2:
            return None
        return int(at // self.config.round_s)

    def _deferred(self, replica: SimReplica, update: GroupUpdate, at: float) -> bool:
        """Whether a real fetch round defers this update past its Delayed Nesterov fold
        (merge.shard_round `decide(until_fold=True)`: one sum a round; the updates after the
        fold fetched whole and applied in order, dht.group_exchange_candidates
        `_apply_in_order`): an incoming update applied in a window where an earlier one
        folded. Counted: its whole bf16 update and headers at every live member, on top of the
        slice each fetched for the round (with `fold_own`, from every shard's holders). With
        `second_sum` it joins the round's next weighted sum instead (bench.scale_sim_levers):
        the round's sums message then carries one more slice, once per fold."""
        window = self._window(replica, update, at)
        if window is None or window != replica.fold_window:
            return False
        published = self.published[update.update_id]
        members = self._members(at).get(id(replica), [])
        if self.config.second_sum:  # its sums counted once the window is done: _settle_sums
            replica.sums_members = members
            self.counters["in_later_sum"] += 1
            return True
        for node in members:
            if published.holders:
                self._from_holders(node, published, 0, self.numel, "deferred_whole", at)
            else:
                self._receive(node, "deferred_whole", self.update_bytes + published.header_bytes)
        self.counters["deferred_past_fold"] += 1
        return True

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
