"""Stopping loses nothing: a round stopped midway is saved and finished after a restart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from node.checkpoint import checkpoint_files
from node.config import JoinConfig
from node.events import RecordingEventLog
from node.runtime import Node
from tests.conftest import REPO

SMALL_CORPUS = str(Path(torch.__file__).parent / "functional.py")


class StopAtStep(RecordingEventLog):
    """Records events and asks the node to stop once it reports inner step `step` of `round`."""

    def __init__(self, round_: int, step: int) -> None:
        super().__init__()
        self.at = (round_, step)
        self.node: Node | None = None

    def progress(self, **fields: Any) -> None:
        if (fields["round"], fields["step"]) == self.at and self.node is not None:
            self.node.request_stop()


def _config(tmp_path: Path, name: str, **overrides: Any) -> JoinConfig:
    base: dict[str, Any] = dict(
        model="tiny",
        data=SMALL_CORPUS,
        inner_steps=5,
        batch_size=2,
        eval_batches=1,
        threads=1,
        identity=str(tmp_path / "id.key"),
        checkpoint_dir=str(tmp_path / name),
        log_format="json",
        swarm=False,
        max_rounds=2,
    )
    return JoinConfig(**{**base, **overrides})


def test_a_round_stopped_midway_resumes_at_its_step_bit_identically(tmp_path: Path) -> None:
    straight = Node(_config(tmp_path, "straight"), RecordingEventLog())
    straight.run()

    stopping = StopAtStep(round_=2, step=3)
    first = Node(_config(tmp_path, "split"), stopping)
    stopping.node = first
    first.run()
    saved = stopping.of("checkpoint_saved")[-1]
    assert (saved["round"], saved["step"]) == (1, 3)
    assert stopping.of("stopped")[-1]["reason"] == "interrupted"

    events = RecordingEventLog()
    resumed = Node(_config(tmp_path, "split"), events)
    resumed.run()
    assert events.of("resumed")[0]["step"] == 3
    (done,) = events.of("round_done")
    assert (done["round"], done["steps"], done["resumed_at_step"]) == (2, 5, 3)
    assert done["learner_step"] == 10  # 2 rounds of 5 steps: none redone
    a, b = straight.replica.state_dict(), resumed.replica.state_dict()
    assert torch.equal(a["params"], b["params"])
    assert straight.learner.sampler.num_batches == resumed.learner.sampler.num_batches == 10


def test_checkpoint_weights_are_plain_safetensors_of_the_replica(tmp_path: Path) -> None:
    node = Node(_config(tmp_path, "ckpt", max_rounds=1), RecordingEventLog())
    node.run()
    manifest, weights_file, state_file = checkpoint_files(tmp_path / "ckpt")
    assert json.loads(manifest.read_text())["fingerprint"] == node.fingerprint
    weights = load_file(weights_file)  # no diloco-node code involved
    model = node.learner.model
    assert set(weights) == {name for name, _ in model.named_parameters()}
    node.learner.load_params(node.replica.params)
    for name, param in model.named_parameters():
        assert torch.equal(weights[name], param.detach())
    state = torch.load(state_file, weights_only=True)
    assert "params" not in state["replica"] and state["partial_round"] is None
    kept = (tmp_path / "ckpt").iterdir()
    assert sorted(p.name for p in kept if p.name != ".lock") == sorted(
        p.name for p in (manifest, weights_file, state_file)
    ), "an older generation or a temp file was left behind"


def _join(home: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "node", "join", "--model", "tiny", "--batch-size", "2",
         "--eval-batches", "1", "--threads", "1", "--log-format", "json",
         "--host", "127.0.0.1", "--port", "0", *args],
        cwd=REPO,
        env={**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )  # fmt: skip


def _events(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_ctrl_c_mid_round_then_join_again_redoes_no_step(node_home: Path) -> None:
    """Ctrl+C (SIGINT to the whole process group) in round 1, then the same command again."""
    inner = "40"
    proc = _join(node_home, "--inner-steps", inner)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if '"event": "progress"' in line:  # at least one inner step of round 1 is done
                break
            assert line, "the node exited before its first inner step"
        else:
            raise AssertionError("no inner step within 90 s")
        os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, err[-2000:]
    stopped = _events(rest)
    saved = next(e for e in stopped if e["event"] == "checkpoint_saved")
    assert saved["round"] == 0 and 0 < saved["step"] < int(inner), saved
    assert not any(word in err for word in ("WARN", "ERROR", "Traceback")), err[-2000:]

    again = _join(node_home, "--inner-steps", inner, "--max-rounds", "1")
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-2000:]
    events = _events(out)
    resumed = next(e for e in events if e["event"] == "resumed")
    assert (resumed["round"], resumed["step"]) == (0, saved["step"])
    done = next(e for e in events if e["event"] == "round_done")
    assert done["round"] == 1 and done["steps"] == int(inner)
    assert done["resumed_at_step"] == saved["step"]
    assert done["learner_step"] == int(inner), "steps done before the stop were redone"
