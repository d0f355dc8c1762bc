"""A node publishing with a lossy codec: error feedback survives a restart, bytes are reported;
the merge state (robust windows, learner floor) survives a restart too."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from merge.codec_uplink import UplinkMeter
from merge.codecs import get_codec
from merge.outer import make_outer_optimizer
from node.config import JoinConfig
from node.events import RecordingEventLog
from node.fragment_publishing import FragmentStreams
from node.publishing import WholeUpdates
from node.runtime import Node
from tests.node.test_runtime import offline_node
from tests.node.test_training import _config as offline_config


def _config(tmp_path: Path, checkpoint: str, **overrides: Any) -> JoinConfig:
    """test_training's offline node, publishing with the sparse codec."""
    return offline_config(tmp_path, checkpoint, **{"codec": "sparse", **overrides})


def _crash_after(node: Node, rounds: int) -> None:
    """`rounds` rounds, a checkpoint as the periodic save writes it, then gone without
    stopping (a stopping node flushes its residual: test_a_stopping_node_...)."""
    node.resume()
    for _ in range(rounds):
        node.run_round()
    node.save_checkpoint()
    node.close()


def test_sparse_codec_resumes_bit_identical_with_its_residual(tmp_path: Path) -> None:
    events = RecordingEventLog()
    straight = Node(_config(tmp_path, "straight"), events)
    _crash_after(straight, 3)
    _crash_after(Node(_config(tmp_path, "split"), RecordingEventLog()), 2)
    resumed = Node(_config(tmp_path, "split"), RecordingEventLog())
    _crash_after(resumed, 1)

    assert (
        float(straight.parts.publishing.error_feedback().residual.abs().sum()) > 0
    )  # it did carry something
    assert torch.equal(
        straight.parts.publishing.error_feedback().residual,
        resumed.parts.publishing.error_feedback().residual,
    )
    assert torch.equal(straight.replica.params, resumed.replica.params)
    rounds = events.of("round_done")
    update_bytes = get_codec("sparse").payload_bytes(straight.num_params)
    assert [r["codec"] for r in rounds] == ["sparse"] * 3
    assert all(update_bytes < r["update_bytes"] < update_bytes + 2048 for r in rounds)
    # No peers, no traffic (the counter is the process's: earlier tests may have moved it).
    assert len({(r["bytes_sent"], r["bytes_received"]) for r in rounds}) == 1
    assert straight.heartbeat().bytes_sent == rounds[-1]["bytes_sent"]


def test_a_residual_saved_under_another_codec_is_carried_on_resume(tmp_path: Path) -> None:
    """What was not sent is progress in any codec (--codec auto may restart with another)."""
    crashed = Node(_config(tmp_path, "ckpt", codec="int4"), RecordingEventLog())
    _crash_after(crashed, 1)
    saved = crashed.parts.publishing.error_feedback().residual
    assert bool(saved.any())

    resumed = Node(_config(tmp_path, "ckpt", max_rounds=2, codec="int8"), RecordingEventLog())
    resumed.resume()

    assert resumed.round == 1
    assert torch.equal(resumed.parts.publishing.error_feedback().residual, saved)


def test_a_stopping_node_publishes_its_residual_once_dense(tmp_path: Path) -> None:
    """--max-rounds (as --max-time, Ctrl+C): what the node trained but had not sent goes out
    as one bf16 update before it saves, so it reaches the swarm instead of stopping here."""
    events = RecordingEventLog()
    node = Node(_config(tmp_path, "ckpt", codec="topk", max_rounds=2), events)
    node.run()

    (flushed,) = events.of("residual_flushed")
    merged = events.of("update_merged")
    assert [e["seq"] for e in merged] == [1, 2, 3] and flushed["seq"] == 3
    dense = get_codec("bf16").payload_bytes(node.num_params)
    assert dense < flushed["update_bytes"] < dense + 2048  # bf16, not topk
    assert all(r["update_bytes"] < dense / 10 for r in events.of("round_done"))
    assert not node.parts.publishing.error_feedback().pending()
    names = [e["event"] for e in events.events]
    last_save = len(names) - 1 - names[::-1].index("checkpoint_saved")
    assert names.index("residual_flushed") < last_save  # the saved residual is empty
    resumed = Node(_config(tmp_path, "ckpt", codec="topk", max_rounds=2), RecordingEventLog())
    resumed.resume()
    assert resumed.round == 2 and not resumed.parts.publishing.error_feedback().pending()


def test_the_replica_after_a_flush_is_a_plain_outer_step_on_the_residual(tmp_path: Path) -> None:
    node = offline_node(tmp_path, codec="topk")
    node.run_round()
    node.run_round()
    publishing = node.parts.publishing
    residual = publishing.error_feedback().residual.clone()
    assert bool(residual.any())
    twin = make_outer_optimizer(node.parts.spec.merge.outer, node.num_params)
    twin.load_state_dict(node.replica.outer.state_dict())
    expected = node.replica.params.clone()

    flushed = publishing.flush()

    assert flushed is not None and flushed.result.accepted
    assert flushed.result.robust is None  # nothing clipped it
    twin.plain_step(expected, residual, flushed.result.weight, 1)  # no momentum: a flush
    torch.testing.assert_close(node.replica.params, expected, rtol=0, atol=1e-4)
    assert torch.equal(node.replica.outer.momentum_buffer, twin.momentum_buffer)
    assert publishing.flush() is None  # once: nothing is left


def test_a_fragment_node_flushes_each_fragment_as_a_plain_step(tmp_path: Path) -> None:
    """--fragments P: each fragment's residual goes out as one bf16 fragment flush, applied
    to that fragment's params as a plain step (no momentum), and nothing is left after."""
    node = offline_node(tmp_path, codec="topk", fragments=2, inner_steps=4)
    node.run_round()
    node.run_round()
    publishing = node.parts.publishing
    assert isinstance(publishing, FragmentStreams)
    layout = node.replica.layout
    assert layout is not None
    residuals = [publishing.compressors.part(p).residual.clone() for p in range(2)]
    assert all(bool(r.any()) for r in residuals)
    momentum = [outer.state_dict() for outer in node.replica.outers]
    before = node.replica.params.clone()
    seq = node.stats.seq

    flushed = publishing.flush()

    assert flushed is not None and flushed.result.accepted and node.stats.seq == seq + 2
    dense = sum(get_codec("bf16").payload_bytes(layout.fragment_numel(p)) for p in range(2))
    assert dense < flushed.update_bytes < dense + 4096  # bf16 fragments, not topk
    merged = [p.result for p in publishing.published[-2:]]
    expected, lr = before.clone(), node.parts.spec.merge.outer.lr
    for fragment, (residual, result) in enumerate(zip(residuals, merged, strict=True)):
        share = layout.gather(expected, fragment)
        share -= lr * result.weight / result.learners * residual
        layout.scatter(expected, fragment, share)
    torch.testing.assert_close(node.replica.params, expected, rtol=0, atol=1e-4)
    for outer, state in zip(node.replica.outers, momentum, strict=True):
        assert torch.equal(outer.momentum_buffer, state["buf"])  # type: ignore[arg-type]
    assert not any(publishing.compressors.part(p).pending() for p in range(2))
    assert publishing.flush() is None  # once: nothing is left


def test_a_node_that_published_nothing_flushes_nothing(tmp_path: Path) -> None:
    node = offline_node(tmp_path, codec="topk")
    assert node.parts.publishing.flush() is None


def test_the_robust_windows_and_learner_floor_resume_with_the_replica(tmp_path: Path) -> None:
    """Without them a restarted node judged and sized updates unlike its peers (merge state)."""
    saved = Node(offline_config(tmp_path, "ckpt", max_rounds=5), RecordingEventLog())
    saved.run()
    assert saved.pipeline.robust.median_norm() is not None  # past the robust warm-up
    resumed = Node(offline_config(tmp_path, "ckpt", max_rounds=5), RecordingEventLog())
    resumed.resume()
    assert resumed.pipeline.state_dict() == saved.pipeline.state_dict()
    assert resumed.pipeline.learner_floor.recent_authors(8) == {saved.peer_id}


def _capture_loads(node: Node) -> list[torch.Tensor]:
    loaded: list[torch.Tensor] = []
    load = node.learner.load_params
    node.learner.load_params = lambda flat: (loaded.append(flat.clone()), load(flat))[1]  # type: ignore[method-assign]
    return loaded


def test_a_lossy_codec_starts_its_round_from_the_replica_minus_its_residual(
    tmp_path: Path,
) -> None:
    """What the node trained but has not sent (its residual) stays applied to its own start,
    so it does not relearn it and send it twice; the payload still encodes base - params."""
    node = offline_node(tmp_path, codec="topk")
    node.run_round()
    residual = node.parts.publishing.error_feedback().residual.clone()
    assert bool(residual.any())
    replica = node.replica.params.clone()

    loaded = _capture_loads(node)
    node.run_round()

    torch.testing.assert_close(loaded[0], replica - residual)
    assert node.replica.num_applied == 2


def test_a_fragment_adopts_its_merged_params_minus_its_residual(tmp_path: Path) -> None:
    node = offline_node(tmp_path, codec="topk", fragments=2, inner_steps=2)
    node.run_round()  # fragment 0 published after step 1, fragment 1 after step 2
    layout, publishing = node.replica.layout, node.parts.publishing
    assert layout is not None and isinstance(publishing, FragmentStreams)
    assert publishing.stream is not None
    residual = publishing.error_feedback().state_dict()["residual"]
    assert isinstance(residual, torch.Tensor) and bool(residual.any())

    for p in range(2):  # each fragment's next pseudo-gradient is taken from there
        merged, _ = node.replica.fragment_params(p)
        start = merged - layout.gather(residual, p)
        torch.testing.assert_close(layout.gather(publishing.stream.base, p), start)
    # fragment 1 was published after the last step: the learner holds its start
    torch.testing.assert_close(
        layout.gather(node.learner.params_vector(), 1), layout.gather(publishing.stream.base, 1)
    )


def _auto_node(tmp_path: Path, uplink_bytes_per_s: float) -> tuple[Node, RecordingEventLog]:
    """An offline node with --codec auto whose picker reads a real UplinkMeter fed one busy
    period at `uplink_bytes_per_s` (a node reads the process's, fed by dht.transport)."""
    events = RecordingEventLog()
    node = Node(_config(tmp_path, "ckpt", codec="auto"), events)
    publishing = node.parts.publishing
    assert isinstance(publishing, WholeUpdates) and publishing.auto is not None
    meter = UplinkMeter(min_bytes=1)
    meter.begin(0.0)
    meter.end(10.0, round(10 * uplink_bytes_per_s))
    publishing.auto = replace(publishing.auto, uplink=meter.bytes_per_s)
    node.telemetry.uplink = meter.bytes_per_s
    node.resume()
    return node, events


def test_codec_auto_on_a_thin_link_moves_to_topk_and_says_so(tmp_path: Path) -> None:
    node, events = _auto_node(tmp_path, uplink_bytes_per_s=1000.0)
    for _ in range(3):
        node.run_round()

    rounds = events.of("round_done")
    assert [r["codec"] for r in rounds] == ["bf16", "topk", "topk"]  # bf16 until measured
    assert rounds[1]["update_bytes"] < rounds[0]["update_bytes"] / 10
    (picked,) = events.of("codec_picked")
    assert picked["codec"] == "topk" and picked["uplink_bytes_per_s"] == 1000.0
    assert picked["fits"] is False  # 1 kB/s: nothing fits, the smallest is taken
    assert node.replica.num_applied == 3  # one replica applies bf16 and topk alike
    status = node.status()  # what the dashboard's node view shows
    assert (status.codec, status.codec_auto, status.uplink_bytes_per_s) == ("topk", True, 1000.0)


def test_codec_auto_on_a_fat_link_keeps_bf16(tmp_path: Path) -> None:
    node, events = _auto_node(tmp_path, uplink_bytes_per_s=1e12)
    for _ in range(3):
        node.run_round()

    assert [r["codec"] for r in events.of("round_done")] == ["bf16"] * 3
    (picked,) = events.of("codec_picked")
    assert (picked["codec"], picked["fits"]) == ("bf16", True)
    assert (node.status().codec, node.status().codec_auto) == ("bf16", True)


def test_a_named_codec_is_never_picked_over_and_auto_is_the_default_but_bf16_with_fragments(
    tmp_path: Path,
) -> None:
    node = offline_node(tmp_path, codec="int8")
    publishing = node.parts.publishing
    assert isinstance(publishing, WholeUpdates) and publishing.auto is None
    assert (node.status().codec, node.status().codec_auto) == ("int8", False)
    node.close()
    # auto's outer momentum is every auto codec's: the fingerprint is bf16's
    auto = Node(_config(tmp_path, "auto", codec="auto"), RecordingEventLog())
    auto.close()
    plain = Node(_config(tmp_path, "plain", codec="bf16"), RecordingEventLog())
    plain.close()
    assert auto.fingerprint == plain.fingerprint
    # what a user gets without --codec; fragments and groups keep the codec they start with
    assert JoinConfig().codec == "auto"
    assert _config(tmp_path, "x", codec="auto", fragments=2, inner_steps=4).codec == "bf16"
    assert _config(tmp_path, "y", codec="auto", group_size=3).codec == "bf16"
    assert _config(tmp_path, "z", codec="int8", fragments=2, inner_steps=4).codec == "int8"
