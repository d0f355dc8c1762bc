"""The learner-group simulator: one applied set, flat bytes per node, the JSON line's shape."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from bench.scale_sim import SimConfig, Simulation, parse_sizes, run, tiny_update_bytes
from merge.group_update import ReductionConfig

CALM = SimConfig(rounds=5, linger_rounds=2, kill_rate=0.0, freeze_rate=0.0, join_rate=0.0)
ROW_KEYS = {
    "nodes": int,
    "learners": int,
    "mb_per_node_per_round": float,
    "max_dht_records_read_per_node_per_s": float,
    "agreement": float,
    "lost": int,
    "rounds_to_every_replica": float,
}


def test_without_churn_every_replica_applies_one_set_and_bytes_stay_flat() -> None:
    rows = run([8, 48], CALM)["rows"]
    small, large = rows
    assert [r["learners"] for r in rows] == [1, 4]
    assert all(r["agreement"] == 1.0 and r["lost"] == 0 for r in rows)
    assert all(r["published"] == CALM.rounds * r["learners"] for r in rows)
    # the merged replicas descend the simulated loss, the same at both sizes (5 rounds: ~0.55)
    assert all(r["relative_distance_to_optimum"] < 0.7 for r in rows)
    assert not any(key.startswith("robust_") for r in rows for key in r)
    assert large["mb_per_node_per_round"] <= 3 * small["mb_per_node_per_round"]
    assert small["mb_per_node_per_round"] <= small["all_to_all_mb_per_node_per_round"]
    # reads per node grow with its group and a bounded sample, not with the swarm
    assert (
        large["max_dht_records_read_per_node_per_s"]
        <= 6 * small["max_dht_records_read_per_node_per_s"]
    )


def test_with_kills_freezes_and_joins_the_live_replicas_still_end_on_one_set() -> None:
    stormy = SimConfig(
        rounds=6, linger_rounds=3, kill_rate=0.05, freeze_rate=0.05, join_rate=0.05, seed=3
    )
    sim = Simulation(24, stormy, tiny_update_bytes())
    row = sim.run()
    assert row["killed"] > 0 and row["frozen"] > 0 and row["joined"] > 0
    assert row["agreement"] == 1.0
    live = [n for n in sim.nodes if n.alive]
    applied = {frozenset(n.replica.applied) for n in live}
    assert len(applied) == 1
    # every group update published is on every live replica, or counted as lost
    assert len(next(iter(applied))) + row["lost"] == row["published"]


def test_dishonest_members_are_held_to_the_in_group_bound() -> None:
    """A tenth of the peers send -20x their pseudo-gradient, well signed: clipped to 4x their
    group's median norm, the swarm still descends; unclipped, it climbs."""
    hostile = dataclasses.replace(CALM, dishonest_share=0.1)
    unclipped = dataclasses.replace(hostile, reduction=ReductionConfig(max_norm_to_median=0.0))
    clipped_row = run([48], hostile)["rows"][0]
    unclipped_row = run([48], unclipped)["rows"][0]
    assert clipped_row["agreement"] == unclipped_row["agreement"] == 1.0
    assert clipped_row["relative_distance_to_optimum"] < 1.0
    assert unclipped_row["relative_distance_to_optimum"] > 1.0


def test_the_command_ends_with_one_json_line_of_rows(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import scale

    monkeypatch.setattr(sys, "argv", ["scale", "--sim", "--nodes", "8,16"])
    scale.main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["nodes"] for row in result["rows"]] == [8, 16]
    for row in result["rows"]:
        for key, kind in ROW_KEYS.items():
            assert isinstance(row[key], kind), key


@pytest.mark.parametrize("text", ["", "8,x", "0", "8,-1"])
def test_bad_node_lists_are_refused_with_one_sentence(text: str) -> None:
    with pytest.raises(ValueError, match="--nodes takes"):
        parse_sizes(text)


def test_the_wired_byte_count_is_all_to_all_inside_one_group_and_above_the_design() -> None:
    """`SimConfig.wired` counts what real nodes move as of session 11 (whole bf16 parts to
    every member, each other group's whole update fetched once): with one group of 8 that is
    all-to-all's bytes; with groups it lies between the design's and all-to-all's."""
    from dataclasses import replace

    design = run([8, 48], CALM)["rows"]
    wired = run([8, 48], replace(CALM, wired=True))["rows"]
    small, large = wired
    assert small["mb_per_node_per_round"] == pytest.approx(
        small["all_to_all_mb_per_node_per_round"], rel=0.02
    )
    assert all(
        d["mb_per_node_per_round"] < w["mb_per_node_per_round"]
        for d, w in zip(design, wired, strict=True)
    )
    assert large["mb_per_node_per_round"] < large["all_to_all_mb_per_node_per_round"] / 2


def test_the_scatter_count_is_below_the_wired_one_and_agrees() -> None:
    """`SimConfig.scatter` counts merge.group_shards' messages: inside one group of 8 about
    two updates a round (pieces out, reduced shards back), not seven; with groups, shard
    fetches keep it below the wired (whole) count; every replica still applies one set."""
    from dataclasses import replace

    wired = run([8, 48], replace(CALM, wired=True))["rows"]
    scatter = run([8, 48], replace(CALM, scatter=True))["rows"]
    update_mb = run([8], CALM)["update_mb"]
    assert scatter[0]["mb_per_node_per_round"] < 2.2 * update_mb
    for s, w in zip(scatter, wired, strict=True):
        assert s["mb_per_node_per_round"] < w["mb_per_node_per_round"] / 2
        assert s["agreement"] == 1.0 and s["lost"] == 0


# ---- session 26 (calib26): the shard fetch counted as real nodes move it ----------------------


def _calm_row(**kwargs: object) -> tuple[Simulation, dict[str, object]]:
    config = dataclasses.replace(CALM, scatter=True, group_size=4, balanced=True, **kwargs)
    sim = Simulation(16, config, tiny_update_bytes())
    return sim, sim.run()


def test_a_fixed_group_size_with_balanced_ids_gives_four_groups_of_four() -> None:
    sim, row = _calm_row()
    assert row["learners"] == 4
    assert sim.grouping is not None
    assert sorted(len(m) for m in sim.grouping.members.values()) == [4, 4, 4, 4]


def test_the_sums_are_counted_in_fp32_one_slice_from_each_other_member() -> None:
    """A member receives, each round with other groups' updates, one `sums` message from each
    of the other g - 1 members: its slice of the round's one weighted sum in fp32 (4 bytes a
    value), not the codec's 2 (main counted (g - 1) / g x the bf16 update)."""
    from bench import scale_sim_wire as wire

    sim, _ = _calm_row()
    g = 4
    sizes = [wire.slice_values(sim.numel, g, rank) for rank in range(g)]
    # each member receives the others' messages: each slice's message reaches g - 1 members
    per_round = (g - 1) * sum(wire.sums_bytes(n, 1) for n in sizes)
    assert sim.by_kind["sums"] == pytest.approx(CALM.rounds * 4 * per_round)
    bf16 = dataclasses.replace(CALM, scatter=True, group_size=4, balanced=True, sums_width=2)
    half = Simulation(16, bf16, tiny_update_bytes())
    half.run()
    assert half.by_kind["sums"] < 0.51 * sim.by_kind["sums"]


def test_the_sums_message_is_sized_as_the_real_encoder_writes_it() -> None:
    import torch

    from bench import scale_sim_wire as wire
    from dht.shard_fetch_wire import FetchMessage

    values = torch.randn(1000) / 3  # not bf16 values: the sums travel in fp32
    message = FetchMessage("scale-sim", ("group:0b01", 1, 1), "sums", "", {}, (values,))
    real = len(message.signed(wire._SENDER).to_bytes())
    assert wire.sums_bytes(1000, 1) == real


def test_parts_and_proposals_are_sized_as_the_real_encoder_writes_them() -> None:
    """A part is a (3 + K)^2 Gram matrix in JSON floats (not 8 bytes a value of the upper
    triangle); a proposal names K ids with holders and g state blocks."""
    import torch

    from bench import scale_sim_wire as wire
    from dht.shard_fetch_wire import FetchMessage, part_message
    from merge.shard_part import wire_part
    from merge.shard_round import part_gram

    k = 5
    gram = wire_part(part_gram([torch.randn(4096) for _ in range(3 + k)]))
    body, tensors = part_message(gram or [], ["0" * 64] * k)
    message = FetchMessage("scale-sim", ("group:0b01", 1, 1), "part", "", body, tensors)
    real = len(message.to_bytes()) + 2 * 64 + len(wire._SENDER.peer_id)  # once signed
    assert wire.part_bytes(k) == pytest.approx(real, rel=0.1)
    assert wire.part_bytes(k) > 4 * (3 + k) * (4 + k) / 2  # float32 since session 29
    assert wire.propose_bytes(k, 4) > wire.propose_bytes(0, 4) + k * 2 * 50


def test_the_fetch_round_replaces_the_designs_all_gather() -> None:
    """With shard fetches a round gathers the sums, not the weighted incoming shards (main
    counted both), and the slices and sums together cost more than exact slices in bf16."""
    sim, row = _calm_row()
    kinds = row["mb_per_node_per_round_by_kind"]
    assert isinstance(kinds, dict)
    assert "all_gather" not in kinds and "whole_fetch" not in kinds
    assert {"propose", "part", "slices", "sums"} <= set(kinds)


def test_an_update_past_the_rounds_fold_is_fetched_whole_by_every_member() -> None:
    """Counted as sessions 18-26 ran it (`second_sum` off: `decide(until_fold=True)`): the
    updates after a fold in the same round are fetched whole, on top of their slices."""
    sim, _ = _calm_row(second_sum=False, fold_own=False)  # folded: its own is a candidate too
    key, replica = next(iter(sim.replicas.items()))
    other = next(p for p in sim.published.values() if p.update.head.group_key != key)
    at = other.at + 1.0
    window = int(at // CALM.round_s)
    members = sim._members(at)[id(replica)]
    before = sim.by_kind["deferred_whole"]
    replica.fold_window = window - 1
    assert not sim._deferred(replica, other.update, at)  # a fold in an earlier round: taken
    replica.fold_window = window
    assert sim._deferred(replica, other.update, at)
    whole = sim.update_bytes + other.header_bytes
    assert sim.by_kind["deferred_whole"] - before == pytest.approx(len(members) * whole)
    own = next(p for p in sim.published.values() if p.update.head.group_key == key)
    assert not sim._deferred(replica, own.update, at)  # its own group's: no fetch round


def test_the_command_takes_a_group_size_like_join(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bench import scale

    argv = ["scale", "--sim", "--nodes", "16", "--group-size", "4", "--balanced", "--scatter"]
    monkeypatch.setattr(sys, "argv", argv)
    scale.main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [row["learners"] for row in result["rows"]] == [4]
