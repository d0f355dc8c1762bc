"""A checkpoint written before the node/ refactor (issue 21) resumes after it.

The checkpoint is written at test time by the code of commit BEFORE, taken from git: a run
stopped midway through round 2, so the replica, the learner, the error feedback and the partial
round all come from the old code. The current code must resume it bit-identically.

The merge rules are part of the run's fingerprint, and they changed since BEFORE (issue 20's
fresh cohort: `cohort_share`, record and progress by substance), so today's node refuses the
old checkpoint as another run's, in one line: a swarm never mixes replicas that decide updates
differently. What this test pins is the format: relabelled with today's fingerprint (its
manifest and its state file), the old checkpoint resumes bit-identically.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from node.checkpoint import MANIFEST_FILE, CheckpointError
from node.events import RecordingEventLog
from node.runtime import Node
from tests.conftest import REPO
from tests.node.test_stopping import _config
from tests.timeouts import covering

BEFORE = "22c5767e5d91344d843970e43dd28dbf5c9692f0"
ARCHIVE_S = 60
"""git archive of the old code."""
OLD_CODE_RUN_S = 600
"""The old code writing its checkpoint in a process of its own."""
"""The last commit before node/ was split into app, trainer, publishing, telemetry, persistence.

It already has issue 20's merge rules (per-author budgets, centered clipping): those are part of
the run fingerprint, so checkpoints of earlier commits belong to another rule set and are refused
as another run's (docs/open-swarms.md); this test is about the refactor's checkpoint format."""

WRITE_WITH_OLD_CODE = """
import sys
from pathlib import Path
from tests.node.test_stopping import StopAtStep, _config
from node.runtime import Node

stopping = StopAtStep(round_=2, step=3)
node = Node(_config(Path(sys.argv[1]), "split"), stopping)
stopping.node = node
node.run()
saved = stopping.of("checkpoint_saved")[-1]
assert (saved["round"], saved["step"]) == (1, 3), saved
"""


def _relabel(directory: Path, fingerprint: str) -> None:
    """The checkpoint in `directory` as if written under `fingerprint` (nothing else changed)."""
    manifest_path = directory / MANIFEST_FILE
    manifest = json.loads(manifest_path.read_text())
    manifest["fingerprint"] = fingerprint
    manifest_path.write_text(json.dumps(manifest))
    state_path = directory / Path(manifest["state"]).name
    state = torch.load(state_path, map_location="cpu", weights_only=True)
    state["fingerprint"] = fingerprint
    torch.save(state, state_path)


def _old_code(dest: Path) -> Path:
    try:
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", BEFORE, "node", "dht", "merge", "dashboard"],
            capture_output=True,
            check=True,
            timeout=ARCHIVE_S,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"commit {BEFORE} is not in this clone ({exc}); a shallow clone lacks it")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest


@pytest.mark.timeout(covering(ARCHIVE_S, OLD_CODE_RUN_S))
def test_a_checkpoint_of_the_old_code_resumes_bit_identically(tmp_path: Path) -> None:
    old = _old_code(tmp_path / "old")
    env_path = f"{old}:{REPO}"  # the old node/, dht/, merge/; the current tests/ helpers
    subprocess.run(
        [sys.executable, "-c", WRITE_WITH_OLD_CODE, str(tmp_path)],
        env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"},
        cwd=tmp_path,
        check=True,
        timeout=OLD_CODE_RUN_S,
    )
    straight = Node(_config(tmp_path, "straight"), RecordingEventLog())
    straight.run()

    with pytest.raises(CheckpointError, match="belongs to a different run"):
        Node(_config(tmp_path, "split"), RecordingEventLog()).run()
    _relabel(tmp_path / "split", straight.fingerprint)
    events = RecordingEventLog()
    resumed = Node(_config(tmp_path, "split"), events)
    resumed.run()
    assert events.of("resumed")[0]["step"] == 3
    (done,) = events.of("round_done")
    assert (done["round"], done["steps"], done["resumed_at_step"]) == (2, 5, 3)
    assert done["learner_step"] == 10
    a, b = straight.replica.state_dict(), resumed.replica.state_dict()
    assert torch.equal(a["params"], b["params"])
