"""Several nodes on one machine: separate identities and checkpoints, clear collisions."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from node.config import JoinConfig
from node.events import RecordingEventLog
from node.runtime import Node
from tests.conftest import REPO, run_cli
from tests.timeouts import CLI_ERROR_S, EXIT_S, ONE_ROUND_RUN_S, START_S, covering

# The default --port: the second node finds 31337 taken and listens on any free port.
TINY = ["join", "--model", "tiny", "--batch-size", "2", "--eval-batches", "1", "--threads", "1",
        "--log-format", "json", "--host", "localhost"]  # fmt: skip
PACED = ["--speed-factor", "10"]
"""The first node only holds the default identity, port and checkpoint dir while the others
run: its inner steps are paced to a tenth of a core (unpaced, it kept one of CI's two cores
busy for the whole test, beside the runs it waits on)."""


@pytest.mark.timeout(covering(START_S, 2 * ONE_ROUND_RUN_S, 2 * CLI_ERROR_S, EXIT_S))
def test_a_second_node_with_default_paths_runs_as_its_own_and_an_explicit_shared_key_is_refused(
    node_home: Path,
) -> None:
    first = subprocess.Popen(
        [sys.executable, "-m", "node", *TINY, "--inner-steps", "1000", *PACED],
        cwd=REPO,
        env={**os.environ, "HOME": str(node_home), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert first.stdout is not None
        deadline = time.monotonic() + START_S
        started = None
        while started is None and time.monotonic() < deadline:
            line = first.stdout.readline()
            assert line, "the first node exited early"
            if '"event": "started"' in line:
                started = json.loads(line)
        assert started is not None, f"the first node did not start within {START_S} s"

        # Default paths: the second node takes the next free default identity.
        run = [*TINY, "--max-rounds", "1", "--inner-steps", "2"]
        code, events, err = run_cli(run, home=node_home, timeout_s=ONE_ROUND_RUN_S)
        assert code == 0, err[-2000:]
        second = next(e for e in events if e["event"] == "started")["peer_id"]
        assert second != started["peer_id"]
        assert (node_home / ".diloco" / "identity-2.key").exists()

        # An identity given explicitly is never swapped, even the default path spelled out:
        # in use, it is a one-line error. (Both spellings at once, beside the restart below:
        # each is refused before it takes anything, so they share one start-up's wait.)
        env = {**os.environ, "HOME": str(node_home)}
        refused = [
            subprocess.Popen(
                [sys.executable, "-m", "node", *run, "--identity", shared],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for shared in (str(node_home / ".diloco" / "identity.key"), "~/.diloco/identity.key")
        ]
        try:
            # It keeps that identity when restarted while the first still runs.
            code, events, err = run_cli(run, home=node_home, timeout_s=ONE_ROUND_RUN_S)
            assert code == 0, err[-2000:]
            assert next(e for e in events if e["event"] == "started")["peer_id"] == second

            for proc in refused:
                _, err = proc.communicate(timeout=CLI_ERROR_S)
                lines = [line for line in err.splitlines() if "error:" in line]
                assert proc.returncode == 1 and len(lines) == 1, err[-2000:]
                assert "identity" in lines[0] and "in use" in lines[0]
                assert "--identity" in lines[0]
        finally:
            for proc in refused:
                proc.kill()
                proc.wait(timeout=EXIT_S)
    finally:
        os.killpg(first.pid, signal.SIGINT)
        _, err = first.communicate(timeout=EXIT_S)
    assert first.returncode == 0, err[-2000:]
    run_dir = node_home / ".diloco" / "checkpoints" / "diloco-default"
    assert sorted(p.name for p in run_dir.iterdir()) == sorted([started["peer_id"], second])
    manifest = json.loads((run_dir / started["peer_id"] / "checkpoint.json").read_text())
    assert manifest["fingerprint"] == started["fingerprint"]
    assert (run_dir / second / "checkpoint.json").exists()


def test_a_checkpoint_in_the_old_default_dir_moves_to_the_nodes_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    config = dict(
        model="tiny",
        data=str(Path(torch.__file__).parent / "functional.py"),
        inner_steps=2,
        batch_size=2,
        eval_batches=1,
        threads=1,
        swarm=False,
        max_rounds=1,
    )
    first = Node(JoinConfig(**config), RecordingEventLog())  # type: ignore[arg-type]
    first.run()
    own = first.checkpoint_dir
    run_dir = own.parent
    for path in own.iterdir():  # as an older version left it: directly in the run's dir
        path.replace(run_dir / path.name)
    own.rmdir()

    events = RecordingEventLog()
    again = Node(JoinConfig(**{**config, "max_rounds": 2}), events)  # type: ignore[arg-type]
    again.run()
    assert events.of("checkpoint_moved")[0]["src"] == str(run_dir)
    assert events.of("resumed")[0]["round"] == 1
    assert (own / "checkpoint.json").exists() and not (run_dir / "checkpoint.json").exists()
