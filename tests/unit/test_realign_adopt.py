"""After a realignment's adopt (dht.realign): the updates this node had applied that the donor
lacked are merged again from its retained copies, through real pipelines, and nothing the
donor had is merged twice."""

from __future__ import annotations

import torch

from dht.realign import lacking_retained, merge_retained
from dht.retention import RetainedUpdates
from merge.envelope import SignedUpdate
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.weighting import TokenWeightConfig
from tests import factories

ME, PEER = factories.identity("me"), factories.identity("peer")
MERGE = MergeConfig(
    outer=OuterConfig(kind="nesterov", lr=0.1, momentum=0.9),
    token_weight=TokenWeightConfig(reference_tokens=1000),
    max_inner_steps=100,
    max_tokens_per_step=100,
)


def replica_pipeline() -> UpdatePipeline:
    replica = Replica(torch.full((64,), 10.0), make_outer_optimizer(MERGE.outer, 64))
    pipeline = UpdatePipeline(replica, MERGE, factories.FINGERPRINT)
    pipeline.clock = lambda: 1000.0
    return pipeline


def signed(author: Identity, seq: int) -> SignedUpdate:
    delta = torch.randn(64, generator=torch.Generator().manual_seed(seq)) / 8
    return factories.sealed_update(
        author, seq=seq, fingerprint=factories.FINGERPRINT, numel=64, created_at=999.0,
        payload=factories.encoded(delta),
    )  # fmt: skip


def test_own_updates_the_donor_had_not_applied_are_applied_again_after_the_adopt() -> None:
    """This node merged and retained the peer's seqs 1-4 and its own 1-2 (just published);
    the donor has the peer's 1-3 only. After the adopt, the own updates and the peer's 4 are
    merged again from the retained copies, and nothing the donor had is merged twice."""
    node, donor = replica_pipeline(), replica_pipeline()
    retained = RetainedUpdates(per_author=8, budget_bytes=1 << 20)
    for update in [signed(PEER, 1), signed(PEER, 2), signed(ME, 1), signed(PEER, 3)]:
        assert node.submit(update).accepted
        retained.put(update.header.update_id, update.to_bytes())
    for update in [signed(ME, 2), signed(PEER, 4)]:
        assert node.submit(update).accepted
        retained.put(update.header.update_id, update.to_bytes())
    for seq in (1, 2, 3):
        assert donor.submit(signed(PEER, seq)).accepted

    node.adopt(donor.transfer_state())
    lacking = lacking_retained(retained, node.replica)
    assert lacking == [(ME.peer_id, 1), (ME.peer_id, 2), (PEER.peer_id, 4)]
    results = merge_retained(retained, node)
    assert [(r.author, r.seq, r.accepted) for r in results] == [
        (ME.peer_id, 1, True), (ME.peer_id, 2, True), (PEER.peer_id, 4, True),
    ]  # fmt: skip
    assert merge_retained(retained, node) == []  # nothing left to merge
    # the donor applies the same three when they reach it: one applied set again
    for update in [signed(ME, 1), signed(ME, 2), signed(PEER, 4)]:
        assert donor.submit(update).accepted
    assert node.replica.applied_digest() == donor.replica.applied_digest()
