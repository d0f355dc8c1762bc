"""A node publishing with a lossy codec: error feedback survives a restart, bytes are reported;
the merge state (robust windows, learner floor) survives a restart too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from merge.codecs import get_codec
from node.config import JoinConfig
from node.events import RecordingEventLog
from node.publishing import FragmentStreams
from node.runtime import Node
from tests.node.test_runtime import offline_node
from tests.node.test_training import _config as offline_config


def _config(tmp_path: Path, checkpoint: str, **overrides: Any) -> JoinConfig:
    """test_training's offline node, publishing with the sparse codec."""
    return offline_config(tmp_path, checkpoint, **{"codec": "sparse", **overrides})


def test_sparse_codec_resumes_bit_identical_with_its_residual(tmp_path: Path) -> None:
    events = RecordingEventLog()
    straight = Node(_config(tmp_path, "straight", max_rounds=3), events)
    straight.run()
    Node(_config(tmp_path, "split", max_rounds=2), RecordingEventLog()).run()
    resumed = Node(_config(tmp_path, "split", max_rounds=3), RecordingEventLog())
    resumed.run()

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


def test_a_residual_saved_under_another_codec_is_dropped_on_resume(tmp_path: Path) -> None:
    Node(_config(tmp_path, "ckpt", max_rounds=1, codec="int4"), RecordingEventLog()).run()

    resumed = Node(_config(tmp_path, "ckpt", max_rounds=2, codec="int8"), RecordingEventLog())
    resumed.resume()

    assert resumed.round == 1 and bool(
        (resumed.parts.publishing.error_feedback().residual == 0).all()
    )


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
