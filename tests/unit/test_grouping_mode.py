"""A swarm too small for a learner group (dht.grouping_mode, session 25 phase25): a census of
two (or below --group-size) publishes each node's own update instead of forming a group of
two either member could void, or forming nothing and training one model per node; while a
peer it reads announces a grouping it waits, as a node short of its swarm's census must."""

from __future__ import annotations

from pathlib import Path

import torch
from hypothesis import given
from hypothesis import strategies as st

from dht.grouping import MIN_MEMBERS
from dht.grouping_mode import RoundMode, round_mode
from dht.heartbeat import Heartbeat
from merge.identity import Identity
from node.group_publishing import GroupPublishing
from node.learner import RoundStats
from node.progress import RoundProgress
from node.snapshot import PeerSighting
from node.swarm_link import OfflineSwarm
from tests.node.test_runtime import offline_node


@given(
    num_peers=st.integers(1, 40),
    group_size=st.sampled_from([1, 3, 4, 8]),
    num_grouped=st.integers(0, 39),
    small_before=st.booleans(),
)
def test_groups_form_only_where_no_member_can_void_one(
    num_peers: int, group_size: int, num_grouped: int, small_before: bool
) -> None:
    """A group forms from a census of at least max(--group-size, MIN_MEMBERS), or of a node
    alone at --group-size 1; never from two; a census of two or more below that publishes
    each node's own update when the previous decision's was too small as well and no peer
    in it announces a grouping."""
    num_grouped = min(num_grouped, num_peers - 1)
    mode = round_mode(num_peers, group_size, num_grouped, small_before)
    if num_peers == 2:
        assert mode is not RoundMode.GROUP
    if mode is RoundMode.GROUP:
        assert num_peers >= max(group_size, MIN_MEMBERS) or num_peers == group_size == 1
    elif num_peers >= 2 and num_grouped == 0 and small_before:
        assert mode is RoundMode.SOLO
    else:
        assert mode is RoundMode.WAIT
        assert num_grouped > 0 or num_peers == 1 or not small_before


def test_two_peers_publish_their_own_at_any_group_size() -> None:
    for group_size in (1, 3, 4):
        assert round_mode(2, group_size, 0) is RoundMode.SOLO
    assert round_mode(3, 4, 0) is RoundMode.SOLO  # three with --group-size 4: not two models
    assert round_mode(3, 3, 0) is RoundMode.GROUP
    assert round_mode(1, 3, 0) is RoundMode.WAIT  # a founder alone waits for peers
    assert round_mode(1, 1, 0) is RoundMode.GROUP  # a group of one: nobody to void it
    assert round_mode(2, 3, 1) is RoundMode.WAIT  # its census is short of a swarm of groups
    assert round_mode(2, 3, 0, small_before=False) is RoundMode.WAIT  # a first read, a dip


class OnePeer(OfflineSwarm):
    """An offline swarm whose census holds one more live peer (its heartbeat as given)."""

    def __init__(self, heartbeat: Heartbeat) -> None:
        self.heartbeat = heartbeat

    def sightings(self, now: float) -> tuple[PeerSighting, ...]:
        return (PeerSighting(self.heartbeat, True, 1.0),)


def _paired(tmp_path: Path, group_size: int, group_bits: int | None = None) -> GroupPublishing:
    node = offline_node(tmp_path, group_size=group_size, codec="fp32")
    publishing = node.parts.publishing
    assert isinstance(publishing, GroupPublishing)
    peer = Identity.generate().peer_id
    beat = Heartbeat(peer_id=peer, state="training", latest_seq=0, group_bits=group_bits)
    publishing.publisher.swarm = OnePeer(beat)
    return publishing


def _round(publishing: GroupPublishing) -> None:
    """One round's end, as node.trainer calls it, with a pseudo-gradient of ones."""
    base = publishing.begin(None)
    end = base.base - 1e-3 * torch.ones_like(base.base)
    stats = RoundStats(num_steps=2, tokens=8, loss=1.0, compute_s=0.1)
    publishing.finish(RoundProgress(base.base, base.base_applied), stats, params=end)


def test_a_node_with_one_peer_publishes_its_own_update_and_forms_no_group(
    tmp_path: Path,
) -> None:
    """Wiring (node.group_publishing): at --group-size 3 and 1 a census of two waits one
    round (its first decision: the census may be a first read), then applies this node's
    own update carrying both rounds (seq 1, then 2, under its own id) and announces no
    grouping; before session 25 --group-size 3 applied nothing and --group-size 1 formed a
    group of two."""
    for group_size in (3, 1):
        publishing = _paired(tmp_path / str(group_size), group_size)
        _round(publishing)
        (published,) = publishing.published
        assert not published.result.accepted and publishing.replica.applied == {}
        for seq in (1, 2):
            _round(publishing)
            (published,) = publishing.published
            assert published.result.accepted, published.result
            assert publishing.replica.last_seq(publishing.me) == seq
        assert publishing.announced() is None
        assert not publishing.error_feedback().pending()


def test_a_node_whose_one_peer_announces_a_grouping_waits(tmp_path: Path) -> None:
    """A node reading one peer of a swarm in groups (a restart before its census filled)
    publishes nothing of its own: its round stays in the residual."""
    publishing = _paired(tmp_path, 3, group_bits=1)
    _round(publishing)
    (published,) = publishing.published
    assert not published.result.accepted
    assert publishing.replica.applied == {}
    assert publishing.error_feedback().pending()
