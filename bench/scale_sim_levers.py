"""Two levers on the bytes of issue 22's fetch round, counted message by message in the
simulator (session 27, levers27; neither is wired in real nodes). A part of
:class:`bench.scale_sim.Simulation` (a mixin, as bench.scale_sim_deliver).

`SimConfig.fold_own`: today a member all-gathers twice a round, its own group's reduced
shards ((g - 1) / g x U in bf16, with the reducers' signatures) and then the fetch round's
fp32 sums. Folded, the own update is one more candidate of its members' fetch round: each
member already holds its reduced shard, which is its slice when the live members are the
group's listed ones, so inside the group only the reducers' signatures travel (with
`fold_own_replicas` r > 1 each shard also goes to the r - 1 included members after its
reducer), and the round's sums carry the own update. What it adds: a proposal id and a
row and column of the Gram matrix per member-round; a member whose slice is not exactly
the shards it holds fetches the rest from their holders (`own_slices`, without the fields
its members co-signed); no member holds the update whole, so another group's member asks
each holder of a shard overlapping its slice (one answer per holder, the first with the
update's fields, the others with their shards alone: a wire change, as the fold is), and
a whole fetch (past a fold) asks every holder. A shard whose every holder is dead or
frozen when asked is counted (`fold_own_unavailable`): nobody can then assemble that
update.

`SimConfig.second_sum`: the updates a fetch round defers past a Delayed Nesterov fold are
fetched whole today (`deferred_whole`); taken as a further weighted sum of the same round
(`ShardRound.decide` without `until_fold`), each member receives one more fp32 slice from
each other member for the round instead. merge.shard_round_replay's `combos_of` forms the
state from at most three sums whatever the folds (params, momentum and round sum are three
rows), so the wire's MAX_SUMS = 3 always holds them: `sums_needed`.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections import Counter
from collections.abc import Callable

from bench import scale_sim_wire as wire
from bench.scale_sim_state import Published, SimConfig, SimNode, SimReplica
from dht.shard_fetch_slices import BARE_SLICE_MAGIC
from dht.shard_fetch_wire import MAX_SUMS
from merge.codecs import Codec
from merge.group_chunks import aligned_bounds
from merge.group_update import GroupUpdate
from merge.shard_holders import shard_holders as holders_of


def shard_holders(update: GroupUpdate, replicas: int) -> tuple[tuple[str, ...], ...]:
    """Who holds each reduced shard of `update` once its group folds it into the fetch round:
    merge.shard_holders' rule, as nodes derive it (the shard's reducer, then the next
    `replicas` - 1 included members after it, sorted order, wrapping)."""
    return tuple(holders_of(update, k, replicas) for k in range(update.num_shards))


@functools.lru_cache(maxsize=1024)
@functools.lru_cache(maxsize=1024)
def cut(numel: int, num_shards: int) -> list[tuple[int, int]]:
    """merge.group_chunks `aligned_bounds` (every split is on the chunk grid since session
    27), kept: the sim cuts one model a few ways many times."""
    return aligned_bounds(numel, num_shards)


@functools.lru_cache(maxsize=1024)
def _ends(numel: int, num_shards: int) -> list[int]:
    return [e for _, e in cut(numel, num_shards)]


@functools.lru_cache(maxsize=64)
def _ranks(included: tuple[str, ...]) -> dict[str, int]:
    return {peer: i for i, peer in enumerate(sorted(included))}


def shards_only_framing(key: str = "groups.0b01101", seq: int = 123456) -> int:
    """A `group-slice` answer's bytes beside its tensors without the update's fields (what a
    further holder of a folded update answers: dht.shard_fetch_slices' `DSS3`, naming the
    update's id and variant; a key of 5 bits and a 6-digit seq)."""
    meta = {
        "id": [key, seq], "variant": "0" * 64,
        "shards": [], "sizes": [], "digests": [], "codec": "bf16",
    }  # fmt: skip  # pieces: pieces_extra
    return len(BARE_SLICE_MAGIC) + 4 + len(json.dumps(meta, separators=(",", ":")))


SHARDS_ONLY = shards_only_framing()


def sums_message(num_values: int, num_sums: int, width: int) -> int:
    """One member's `sums` message with `num_sums` slices of `num_values` values at `width`
    bytes a value (the real encoder's framing: bench.scale_sim_wire `sums_bytes`)."""
    framing = wire.sums_bytes(num_values, num_sums) - wire.SUMS_WIDTH * num_sums * num_values
    return framing + width * num_sums * num_values


def sums_needed(folds: int, tail: bool) -> int:
    """Weighted sums a fetch round gathers when nothing is deferred, with `folds` Delayed
    Nesterov folds inside it and (`tail`) updates after the last one: the independent rows
    among the momentum's, the round sum's and the params' coefficients on the round's
    updates (merge.shard_round_replay `combos_of`; tests check it against the replay)."""
    return min(max(1, min(folds, 2) + int(tail)), MAX_SUMS)


class Levers:
    """Simulation's counts for `fold_own` and `second_sum`."""

    # what it reads of Simulation (bench.scale_sim), which sets or defines each
    config: SimConfig
    codec: Codec
    numel: int
    by_id: dict[str, SimNode]
    counters: Counter[str]
    _receive: Callable[[SimNode, str, float], None]

    def folds_own(self, learners: int) -> bool:
        """Whether a group round at `learners` folds its update into the fetch round (one
        group alone has no fetch round: its update is all-gathered as today)."""
        c = self.config
        return c.fold_own and c.scatter and not c.wired and learners >= 2

    def _gathered(
        self,
        member: str,
        reducer: str,
        piece: int,
        frames: tuple[int, int],
        learners: int,
        included: tuple[str, ...],
    ) -> None:
        """What `member` receives of `reducer`'s reduced shard in a group round's all-gather
        (bench.scale_sim_reduce; `frames`: a `DGS3`'s bytes beyond its values, a `DGS4`
        seal's): the shard and its frame, or with `fold_own` a seal, and the shard with its
        frame only if it is one of the shard's r - 1 replicas (as dht.group_exchange_shards
        sends them since session 29)."""
        node = self.by_id[member]
        if not node.alive:
            return
        cosign, seal = frames
        if not self.folds_own(learners):
            self._receive(node, "group_round", piece + cosign)
            return
        ranks = _ranks(included)
        after = (ranks[member] - ranks[reducer]) % len(ranks)
        if after < self.config.fold_own_replicas:
            self._receive(node, "group_round", cosign)
            self._receive(node, "shard_replicas", piece)
        else:
            self._receive(node, "group_round", seal)

    def _from_holders(
        self, node: SimNode, published: Published, start: int, end: int, kind: str, now: float
    ) -> None:
        """`node` fetches values [start, end) of a folded update from its shards' holders:
        per holder asked one `group-slice` answer with exactly the range's values of its
        shards and their chunk digest lists (the chunk grid), the first of them with the
        update's fields (none to its own members, who co-signed them); nothing for a shard
        it holds; a shard with no live holder counted as unavailable."""
        update = published.update
        bounds = cut(self.numel, update.num_shards)
        first = bisect.bisect_right(_ends(self.numel, update.num_shards), start)
        asked: dict[str, list[tuple[int, int, int]]] = {}
        payload = 0
        for k in range(first, len(bounds)):
            s, e = bounds[k]
            if s >= end:
                break
            if s == e or node.peer_id in published.holders[k]:
                continue
            live = [h for h in published.holders[k] if self._serves(h, now)]
            if not live:
                self.counters["fold_own_unavailable"] += 1
                continue
            a, b = max(s, start), min(e, end)
            asked.setdefault(live[0], []).append((k, a, b))
            payload += self.codec.payload_bytes(b - a)
        if asked:
            fields = 0 if kind == "own_slices" else published.slice_meta - SHARDS_ONLY
            extra = sum(wire.pieces_extra(self.numel, bounds, p) for p in asked.values())
            self._receive(node, kind, fields + len(asked) * SHARDS_ONLY + payload + extra)

    def _serves(self, peer: str, now: float) -> bool:
        node = self.by_id[peer]
        return node.alive and not node.frozen(now)

    def _settle_sums(self, replica: SimReplica) -> None:
        """With `second_sum`, once a window's folds are all known (the next window folds, or
        the run ends): the further sums its round gathered, in each member's `sums` message
        from each other member (the members that took its latest update past a fold)."""
        num_sums = sums_needed(replica.window_folds, replica.window_tail)
        if self.config.second_sum and num_sums > 1:
            self._more_sums(replica.sums_members, num_sums, num_sums - 1)
        replica.window_folds, replica.window_tail, replica.sums_members = 0, False, []

    def _more_sums(self, members: list[SimNode], num_sums: int, more: int) -> None:
        """Each member receives, from each other member, `more` further slices of the round's
        sums in its `sums` message (which then carries `num_sums`)."""
        g = len(members)
        if g < 2 or more <= 0:
            return
        width = self.config.sums_width
        for rank, node in enumerate(sorted(members, key=lambda n: n.peer_id)):
            sizes = [wire.slice_values(self.numel, g, j) for j in range(g) if j != rank]
            extra = sum(
                sums_message(n, num_sums, width) - sums_message(n, num_sums - more, width)
                for n in sizes
            )
            self._receive(node, "second_sum", extra)
