"""The simulator's two levers of session 27 (bench.scale_sim_levers): the own group's update
folded into the fetch round, and the updates past a fold taken as a further sum. Each test
checks a count against a hand count on four groups of four, and that the flag moves the
kinds it should and no other."""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest
import torch

from bench import scale_sim_wire as wire
from bench.scale_sim import SimConfig, Simulation, tiny_update_bytes
from bench.scale_sim_levers import SHARDS_ONLY, shard_holders, sums_message, sums_needed
from dht.grouping_shards import ReducedShard, shard_frame_bytes
from merge.group_chunks import aligned_bounds
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.shard_holders import SHARD_REPLICAS
from merge.shard_round_replay import Replay, combos_of

CALM = SimConfig(
    rounds=5,
    linger_rounds=2,
    kill_rate=0.0,
    freeze_rate=0.0,
    join_rate=0.0,
    scatter=True,
    group_size=4,
    balanced=True,
    second_sum=False,  # each lever against session 26's count; tests turn it on
    fold_own=False,  # the default since session 29 (fold29): off here, as second_sum
    fold_own_replicas=1,
)
G, GROUPS = 4, 4


def _row(nodes: int = G * GROUPS, **kwargs: object) -> tuple[Simulation, dict[str, float]]:
    sim = Simulation(nodes, dataclasses.replace(CALM, **kwargs), tiny_update_bytes())
    row = sim.run()
    kinds = row["mb_per_node_per_round_by_kind"]
    assert row["agreement"] == 1.0 and row["lost"] == 0 and isinstance(kinds, dict)
    return sim, dict(sim.by_kind)


def _shards_bytes(sim: Simulation) -> int:
    """One group update's tensors: the sum of its g reduced shards (bf16)."""
    return sum(sim.codec.payload_bytes(e - s) for s, e in aligned_bounds(sim.numel, G))


def _seal_extra() -> int:
    """A `DGS4` seal's bytes beyond a `DGS3` frame's (the digest in, the codec name out)."""
    ids = tuple(sorted(Identity.generate().peer_id for _ in range(G)))
    shard = ReducedShard("groups.0b01", 0, 3, ids, 0, b"s" * 64, torch.zeros(0), ids)
    return len(shard.seal_bytes("0" * 64)) - shard_frame_bytes(shard, "fp32")


def test_folding_the_own_update_drops_the_shards_of_the_group_all_gather_and_nothing_else() -> None:
    """Each round each member no longer receives the g - 1 other reduced shards (only their
    signatures); the fetch round's proposal and part name one more candidate; the sums and
    the other groups' slices stay as they were (four groups of four: slices are shards)."""
    sim, base = _row()
    folded_sim, folded = _row(fold_own=True)
    member_rounds = CALM.rounds * G * GROUPS
    removed = CALM.rounds * GROUPS * (G - 1) * (_shards_bytes(sim) - G * _seal_extra())
    assert base["group_round"] - folded["group_round"] == pytest.approx(removed)
    k = GROUPS - 1
    more_propose = (G - 1) * (wire.propose_bytes(k + 1, G) - wire.propose_bytes(k, G))
    more_part = (G - 1) * (wire.part_bytes(k + 1) - wire.part_bytes(k))
    assert folded["propose"] - base["propose"] == pytest.approx(member_rounds * more_propose)
    assert folded["part"] - base["part"] == pytest.approx(member_rounds * more_part)
    assert folded["sums"] == base["sums"] and folded["slices"] == base["slices"]
    assert "own_slices" not in folded and "shard_replicas" not in folded
    assert folded_sim.counters["fold_own_unavailable"] == 0


def test_a_replicated_shard_costs_one_shard_per_extra_holder() -> None:
    _, one = _row(fold_own=True)
    sim, two = _row(fold_own=True, fold_own_replicas=2)
    assert two["shard_replicas"] == pytest.approx(CALM.rounds * GROUPS * _shards_bytes(sim))
    # the replica holder gets the DGS3 frame, not the seal (session 29)
    assert one["group_round"] - two["group_round"] == CALM.rounds * GROUPS * G * _seal_extra()


def test_a_folded_update_has_its_shards_holders_and_none_serves_a_dead_one() -> None:
    """Reducer first, then the next included members; an outsider's slice is asked of a live
    holder (one answer with the update's fields), and a shard whose holders are all dead is
    counted unavailable, with no bytes."""
    sim, _ = _row(fold_own=True, fold_own_replicas=2)
    published = next(iter(sim.published.values()))
    update = published.update
    included = sorted(h.author for h in update.contributions)
    assert published.holders == shard_holders(update, 2)
    assert [h[0] for h in published.holders] == included  # no loss: shard j is member j's
    assert published.holders[0][1] == included[1]
    outsider = next(n for n in sim.nodes if n.peer_id not in included)
    start, end = aligned_bounds(sim.numel, G)[0]
    before = sim.by_kind["slices"]
    sim._from_holders(outsider, published, start, end, "slices", published.at)
    bounds = aligned_bounds(sim.numel, G)
    lists = [wire.pieces_extra(sim.numel, bounds, [(k, *bounds[k])]) for k in (0, 1)]
    shard = sim.codec.payload_bytes(end - start) + lists[0]  # its chunk digests beside it
    assert sim.by_kind["slices"] - before == wire.slice_meta(update) + shard
    before = sim.by_kind["slices"]
    end_two = bounds[1][1]  # two shards, two holders: the fields once
    sim._from_holders(outsider, published, start, end_two, "slices", published.at)
    two = shard + sim.codec.payload_bytes(end_two - end) + lists[1]
    assert sim.by_kind["slices"] - before == wire.slice_meta(update) + SHARDS_ONLY + two
    for peer in published.holders[0]:
        sim.by_id[peer].alive = False
    before = sim.by_kind["slices"]
    sim._from_holders(outsider, published, start, end, "slices", published.at)
    assert sim.by_kind["slices"] == before
    assert sim.counters["fold_own_unavailable"] == 1


def test_one_group_alone_still_all_gathers_its_update() -> None:
    base = Simulation(8, dataclasses.replace(CALM, group_size=0, balanced=False), 10**6)
    folded = Simulation(8, dataclasses.replace(base.config, fold_own=True), 10**6)
    assert base.run()["mb_per_node_per_round"] == folded.run()["mb_per_node_per_round"]


def test_the_updates_past_a_fold_are_one_more_sum_not_whole_fetches() -> None:
    """Every deferred update of the base run is in a later sum instead: `deferred_whole`
    goes, `second_sum` comes, every other kind is unchanged. (Without churn a round's last
    update completes its fold: 8 groups of 4 with churn defer 7 updates.)"""
    stormy: dict[str, object] = dict(rounds=6, linger_rounds=3, kill_rate=0.03)
    stormy.update(freeze_rate=0.03, join_rate=0.03)
    sim, base = _row(32, **stormy)
    second_sim, second = _row(32, second_sum=True, **stormy)
    assert sim.counters["deferred_past_fold"] == 7
    assert second_sim.counters["in_later_sum"] == sim.counters["deferred_past_fold"]
    assert "deferred_whole" not in second and second["second_sum"] > 0
    assert second["second_sum"] < base["deferred_whole"] / 2
    assert {k: v for k, v in base.items() if k != "deferred_whole"} == {
        k: v for k, v in second.items() if k != "second_sum"
    }


def test_a_rounds_later_sums_are_counted_once_its_folds_are_known() -> None:
    """The updates past a fold add no bytes when taken; once the window is done each member
    receives, from each other member, the round's further sums: one after one fold, two
    after two with a tail, never more than the wire's three."""
    sim, _ = _row(second_sum=True)
    key, replica = next(iter(sim.replicas.items()))
    other = next(p for p in sim.published.values() if p.update.head.group_key != key)
    at = other.at + 1.0
    sizes = [wire.slice_values(sim.numel, G, j) for j in range(G)]

    def per_round(num_sums: int) -> int:
        """All members' `sums` messages with `num_sums` slices each (g - 1 receivers)."""
        return (G - 1) * sum(sums_message(n, num_sums, 4) for n in sizes)

    for folds, tail, sums in ((1, True, 2), (2, True, 3), (3, False, 2), (4, True, 3)):
        replica.fold_window, replica.window_folds = int(at // CALM.round_s), folds
        before = sim.by_kind["second_sum"]
        assert sim._deferred(replica, other.update, at)
        assert sim._deferred(replica, other.update, at)
        assert sim.by_kind["second_sum"] == before  # nothing until the window is done
        replica.window_tail = tail
        sim._settle_sums(replica)
        added = sim.by_kind["second_sum"] - before
        assert added == pytest.approx(per_round(sums) - per_round(1))
        assert replica.window_folds == 0 and not replica.sums_members


@pytest.mark.parametrize("learners", [3, 4])
@pytest.mark.parametrize("num_updates", [1, 3, 4, 5, 7, 8, 9, 12, 13])
def test_the_sums_a_round_needs_are_what_the_real_replay_forms(
    num_updates: int, learners: int
) -> None:
    """merge.shard_round_replay, the real replay `ShardRound.decide` runs on a round of
    `num_updates` (a fold every `learners`): its fewest sums are `sums_needed` of its folds
    and whether updates follow the last one."""
    outer = make_outer_optimizer(OuterConfig(), 8)
    replay = Replay(outer, 3, num_updates)
    tail = False
    for i in range(num_updates):
        folds = replay.folds
        replay.step(replay.update(i) * (1.0 + 0.1 * i), 1.0, learners)
        tail = replay.folds == folds
    combos, _ = combos_of(replay, 3)
    assert replay.folds == num_updates // learners
    assert len(combos) == sums_needed(replay.folds, tail)
    assert np.isfinite(np.array(combos)).all()


def test_the_command_takes_the_levers(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import scale

    base = ["scale", "--sim", "--nodes", "16", "--group-size", "4", "--balanced", "--scatter"]
    monkeypatch.setattr(sys, "argv", [*base, "--fold-own", "--fold-own-replicas", "2"])
    scale.main()
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"][0]
    assert "shard_replicas" in row["mb_per_node_per_round_by_kind"]
    monkeypatch.setattr(sys, "argv", [*base, "--fold-own", "--fold-own-replicas", "0"])
    with pytest.raises(SystemExit):
        scale.main()
    assert "fold_own_replicas is >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("learners", [2, 3])
@pytest.mark.parametrize("num_updates", [2, 3, 4, 5, 6])
def test_the_real_shard_round_takes_the_updates_past_a_fold_in_its_counted_sums(
    num_updates: int, learners: int
) -> None:
    """merge.shard_round on small tensors (`decide` without `until_fold`, what `second_sum`
    counts): the round gathers `sums_needed` sums, defers nothing, and ends where applying
    the updates one by one does (a fold every `learners` updates)."""
    from tests.unit.shard_round_paths import (
        Spec,
        _assert_alike,
        _by_shards,
        _one_by_one,
        _pipeline,
        _update,
    )

    a, b = _pipeline("delayed_nesterov"), _pipeline("delayed_nesterov")
    updates = [_update(Spec(g, 0, "honest", 0, 0), 7, learners) for g in range(num_updates)]
    _one_by_one(a, updates)
    results, plan = _by_shards(b, updates, 3)
    assert plan is not None and not plan.deferred and all(r.accepted for r in results)
    folds = num_updates // learners
    assert len(plan.combos) == sums_needed(folds, num_updates % learners != 0)
    _assert_alike(a, b)


def test_the_default_counts_the_fold_with_two_holders_a_shard_as_nodes_run_it() -> None:
    """Since session 29 (fold29) the own update is folded by default, each shard held by its
    reducer and the next included member (merge.shard_holders' SHARD_REPLICAS)."""
    assert SimConfig().fold_own and SimConfig().fold_own_replicas == SHARD_REPLICAS
