"""Experiment tracking: per-round scalars from the event stream, read back from TensorBoard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from node.config import JoinConfig
from node.events import RecordingEventLog
from node.tracking import RoundMetrics, TensorBoardSink, TrackedEventLog, tracked, wandb_mode

ROUND: dict[str, Any] = {
    "round": 1,
    "loss": 4.0,
    "val_loss": 3.5,
    "tokens_per_s": 1000.0,
    "inner_s": 3.0,
    "round_s": 4.0,
    "num_applied": 3,
    "drift": 0.01,
    "peers_alive": 2,
}
STARTED = {"peer_id": "12D3KooWpeer", "run_id": "r", "model": "tiny", "fingerprint": "f"}


def test_a_round_folds_in_the_merges_and_bytes_since_the_last_one() -> None:
    metrics = RoundMetrics()
    assert metrics.observe("update_merged", {"staleness": 0}) is None
    metrics.observe("update_merged", {"staleness": 3})
    metrics.observe("update_fetched", {"megabytes": 1.5})
    first = metrics.observe("round_done", ROUND)
    assert first is not None
    assert first["staleness_mean"] == 1.5 and first["staleness_max"] == 3
    assert first["goodput"] == 0.75 and first["received_mb"] == 1.5
    assert first["val_loss"] == 3.5 and first["drift"] == 0.01
    second = metrics.observe("round_done", {**ROUND, "val_loss": None, "drift": None})
    assert second is not None
    assert "staleness_mean" not in second  # nothing merged in between
    assert "val_loss" not in second and "drift" not in second
    assert second["received_mb"] == 1.5 and second["updates_merged"] == 2  # cumulative
    # The steps' own time, where round_done has it (the loop's work between steps is not).
    third = metrics.observe("round_done", {**ROUND, "steps_s": 2.0})
    assert third is not None and third["goodput"] == 0.5


def test_tensorboard_holds_every_round_and_the_node_metadata(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason='--tensorboard needs: pip install -e ".[tracking]"')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    inner = RecordingEventLog()
    events = TrackedEventLog(inner, [TensorBoardSink(tmp_path)], org="acme")
    events.emit("started", **STARTED)
    events.emit("update_merged", staleness=2)
    events.emit("round_done", **ROUND)
    events.emit("round_done", **{**ROUND, "round": 2, "loss": 3.0})
    events.close()
    assert [e["event"] for e in inner.events] == ["started", "update_merged"] + ["round_done"] * 2

    log_dir = tmp_path / "r" / "12D3KooWpeer"
    accumulator = EventAccumulator(str(log_dir), size_guidance={"tensors": 0}).Reload()
    losses = accumulator.Scalars("round/loss")
    assert [(s.step, s.value) for s in losses] == [(1, 4.0), (2, 3.0)]
    assert [s.value for s in accumulator.Scalars("round/staleness_mean")] == [2.0]
    for name in ("val_loss", "tokens_per_s", "goodput", "drift", "received_mb"):
        assert len(accumulator.Scalars(f"round/{name}")) == 2, name
    text = accumulator.Tensors("node/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "12D3KooWpeer" in text and "acme" in text


def test_no_tracking_flag_leaves_the_event_log_as_it_is(tmp_path: Path) -> None:
    inner = RecordingEventLog()
    assert tracked(inner, JoinConfig()) is inner
    assert tracked(inner, JoinConfig(tensorboard=str(tmp_path))) is not inner


def test_wandb_goes_offline_without_credentials(tmp_path: Path) -> None:
    assert wandb_mode({"HOME": str(tmp_path)}) == "offline"
    assert wandb_mode({"HOME": str(tmp_path), "WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"HOME": str(tmp_path), "WANDB_MODE": "disabled"}) == "disabled"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password k\n")
    assert wandb_mode({"HOME": str(tmp_path)}) == "online"
