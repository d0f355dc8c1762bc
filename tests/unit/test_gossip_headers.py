"""What gossip does with a header it hears (dht.gossip_headers.Headers.on_header), through the
real merge pipeline and CatchUp: a good one is wanted, a forged one is counted against its
author without settling the id (the real update can still come), an invalid one is counted
and settled, and a header of an update applied here costs nothing. Pushing and DHT reads are
the swarm tests' (tests/swarm); nothing here reaches the network."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from dht.catchup import CatchUp, CatchUpConfig
from dht.gossip_context import GossipContext
from dht.gossip_headers import Headers
from dht.rejections import Rejections
from dht.retention import RetainedUpdates
from dht.swarm_config import SwarmConfig
from merge.envelope import SignedHeader, SignedUpdate
from merge.identity import Identity
from merge.outer import make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.result import MergeResult
from merge.weighting import TokenWeightConfig
from tests.factories import sealed_update

FINGERPRINT = "ab" * 32
ALICE = Identity.generate()
CONFIG = MergeConfig(
    token_weight=TokenWeightConfig(reference_tokens=1000),
    max_inner_steps=100,
    max_tokens_per_step=100,
)


class Offline:
    """The swarm network's config and peer id; on_header sends and reads nothing."""

    def __init__(self) -> None:
        self.config = SwarmConfig(
            run_id="r", fingerprint=FINGERPRINT, run_summary={}, identity_path=""
        )
        self.peer_id = Identity.generate().peer_id


def update(seq: int, inner_steps: int = 10) -> SignedUpdate:
    return sealed_update(
        ALICE, delta=[0.1, -0.1, 0.2, 0.0], fingerprint=FINGERPRINT, seq=seq,
        inner_steps=inner_steps, tokens=500,
    )  # fmt: skip


def headers() -> tuple[Headers, GossipContext, list[MergeResult]]:
    replica = Replica(torch.ones(4), make_outer_optimizer(CONFIG.outer, 4))
    pipeline = UpdatePipeline(replica, CONFIG, FINGERPRINT)
    reported: list[MergeResult] = []
    network: Any = Offline()
    context = GossipContext(
        network=network,
        membership=None,  # type: ignore[arg-type]  # on_header reads no heartbeats
        merge=pipeline,
        catchup=CatchUp(CatchUpConfig(), network.peer_id, replica),
        retained=RetainedUpdates(per_author=4, budget_bytes=1 << 20),
        merge_pool=ThreadPoolExecutor(1),
        reject=Rejections(reported.append, pipeline.rejection_log),
        on_merge=reported.append,
        on_event=lambda *a, **k: None,
        active=True,
    )
    return Headers(context, lambda proof: None), context, reported


def test_a_checked_header_is_wanted_from_its_author() -> None:
    heard, context, reported = headers()
    heard.on_header(update(1).signed_header)
    assert context.catchup.wanted() == [(ALICE.peer_id, 1)]
    assert not reported and not context.reject.counts


def test_a_forged_header_is_counted_and_the_real_update_still_comes() -> None:
    heard, context, reported = headers()
    genuine = update(2).signed_header
    forged = SignedHeader(genuine.header, bytes(len(genuine.signature)))
    heard.on_header(forged)
    assert context.reject.counts["bad_signature"] == 1
    assert [(r.author, r.seq, r.reason) for r in reported] == [(ALICE.peer_id, 2, "bad_signature")]
    assert not context.catchup.knows((ALICE.peer_id, 2))  # a forgery settles nothing
    heard.on_header(genuine)
    assert context.catchup.wanted() == [(ALICE.peer_id, 2)]


def test_an_invalid_header_is_counted_once_and_not_fetched() -> None:
    heard, context, reported = headers()
    invalid = update(3, inner_steps=CONFIG.max_inner_steps + 1).signed_header
    heard.on_header(invalid)
    assert context.reject.counts["bad_steps"] == 1
    assert context.catchup.knows((ALICE.peer_id, 3)) and not context.catchup.wanted()


def test_a_header_of_an_applied_update_costs_nothing() -> None:
    heard, context, reported = headers()
    applied = update(4)
    assert context.merge.submit(applied).accepted
    heard.on_header(applied.signed_header)
    assert not context.catchup.wanted()
    assert not reported and not context.reject.counts
