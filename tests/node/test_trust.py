"""A node in a permissioned run, and what it tells peers about whom it rejected."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dht.heartbeat import Heartbeat
from merge.identity import Identity
from node.cli import main
from node.events import RecordingEventLog
from node.runtime import Node
from node.telemetry import reportable_loss
from tests.dashboard.conftest import node_config
from tests.factories import sealed_update


def foreign_update(node: Node, identity: Identity) -> object:
    return sealed_update(
        identity, fingerprint=node.fingerprint, seq=1, inner_steps=2, tokens=2, loss=1.0,
        numel=node.num_params, created_at=None,
    )  # fmt: skip


def test_a_permissioned_node_ignores_keys_outside_the_list_and_names_them(
    tmp_path: Path,
) -> None:
    me = Identity.generate()
    me.save(tmp_path / "id.key")
    outsider = Identity.generate()
    allow = tmp_path / "allow.toml"
    allow.write_text(f'"lab-a" = ["{me.peer_id}"]\n')
    node = Node(
        node_config(tmp_path, allow_keys=str(allow), dashboard_port=None), RecordingEventLog()
    )
    before = node.replica.params.clone()

    result = node.pipeline.submit(foreign_update(node, outsider))  # type: ignore[arg-type]
    node.report_merge(result)

    assert result.reason == "not_allowed"
    assert torch.equal(node.replica.params, before)
    heartbeat = Heartbeat.verify(node.heartbeat().sign(node.identity), node.peer_id)
    assert heartbeat.rejections["not_allowed"] == 1
    assert heartbeat.rejected_peers == {outsider.peer_id: {"not_allowed": 1}}
    assert node.pipeline.rejection_log.by_peer() == {outsider.peer_id: {"not_allowed": 1}}


def test_a_diverged_loss_is_reported_as_unknown_not_refused() -> None:
    assert reportable_loss(float("nan")) is None and reportable_loss(1e308) is None
    assert reportable_loss(2.5) == 2.5


def test_a_bad_allow_list_is_one_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    allow = tmp_path / "allow.toml"
    allow.write_text('"lab" = ["not-a-key"]\n')
    assert main(["join", "--allow-keys", str(allow), "--no-swarm"]) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "allow.toml" in line and "neither a peer id" in line
