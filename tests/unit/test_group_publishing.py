"""Learner groups in a node (node/group_publishing.py, docs/scale.md wiring plan step 4): a node
alone is a group of one whose update moves its replica exactly as its own fp32 update would,
through the same Trainer, with nothing left in its error feedback."""

from __future__ import annotations

from pathlib import Path

import torch

from dht.grouping import group_key
from dht.heartbeat import Heartbeat
from merge.identity import Identity
from node.group_publishing import GroupPublishing
from node.swarm_link import OfflineSwarm, peers_finished
from tests.node.test_runtime import offline_node


def test_a_node_alone_is_a_group_of_one_that_moves_like_its_own_fp32_update(
    tmp_path: Path,
) -> None:
    key = Identity.generate()  # one key (in two files): the data a node samples follows it
    for name in ("g", "a"):
        (tmp_path / name).mkdir()
        key.save(tmp_path / name / "id.key")
    grouped = offline_node(tmp_path / "g", group_size=1, codec="fp32")
    alone = offline_node(tmp_path / "a", codec="fp32")
    assert isinstance(grouped.parts.publishing, GroupPublishing)
    assert isinstance(grouped.parts.swarm, OfflineSwarm)
    for round_ in (1, 2):
        result = grouped.run_round()
        assert result is not None and result.accepted and result.learners == 1
        assert grouped.replica.applied == {group_key(""): list(range(1, round_ + 1))}
        assert alone.run_round() is not None
        assert torch.allclose(grouped.replica.params, alone.replica.params, atol=1e-6)
    publishing = grouped.parts.publishing
    assert not publishing.error_feedback().pending()  # its own group applied everything
    assert publishing.announced() == (0, 0)


def test_lingering_ends_for_group_members_who_publish_no_update_of_their_own() -> None:
    """--linger-until-done: a learner-group member's updates are its group's (under the group
    key), so its heartbeat's latest seq stays 0 and this replica holds none of its own."""
    member = Heartbeat(peer_id="member", state="idle", latest_seq=0)
    assert peers_finished([member], lambda peer: -1, "me", 0)
    training = Heartbeat(peer_id="member", state="training", latest_seq=0)
    assert not peers_finished([training], lambda peer: -1, "me", 0)
