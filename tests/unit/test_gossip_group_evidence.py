"""A learner group's proof of equivocation in the gossip (dht/gossip_evidence.py): pushed on the
one `evidence` stream beside the solo proofs, checked before anything is done with it, settled
by the merge and passed on once; bad bytes cost their sender a counted rejection. The proof's
logic is tests/unit/test_group_equivocation.py's; this proves the wiring only."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dht.catchup import CatchUp, CatchUpConfig
from dht.gossip_context import GossipContext
from dht.gossip_evidence import Evidence
from dht.rejections import Rejections
from dht.retention import RetainedUpdates
from dht.swarm_config import SwarmConfig
from dht.transport import HEADER, OK
from merge.pipeline import UpdatePipeline
from tests.factories import FINGERPRINT
from tests.unit.test_group_equivocation import UID, A, _pipeline, _proof
from tests.unit.test_group_merge import RUN


@dataclass
class Live:
    peer_id: str


class Network:
    def __init__(self) -> None:
        self.config = SwarmConfig(
            run_id=RUN, fingerprint=FINGERPRINT, run_summary={}, identity_path=""
        )
        self.peer_id = "me"
        self.sent: list[tuple[str, str, bytes]] = []
        self.tasks: list[asyncio.Task[None]] = []

    def spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.append(task)
        return task

    async def send(self, peer: str, name: str, blob: bytes, timeout_s: float) -> None:
        self.sent.append((peer, name, blob))


class Membership:
    def is_alive(self, peer_id: str) -> bool:
        return peer_id != "a-stranger"

    def alive_peers(self) -> list[Live]:
        return [Live("pusher"), Live("other")]


@dataclass
class Info:
    peer_id: str


def _stream(blob: bytes) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(HEADER.pack(OK, len(blob)) + blob)
    reader.feed_eof()
    return reader


async def _push(pipeline: UpdatePipeline, pushes: list[tuple[str, bytes]]) -> dict[str, Any]:
    network = Network()
    retained = RetainedUpdates(per_author=16, budget_bytes=1 << 24)
    ctx = GossipContext(
        network=network,  # type: ignore[arg-type]
        membership=Membership(),  # type: ignore[arg-type]
        merge=pipeline,
        catchup=CatchUp(CatchUpConfig(), network.peer_id, pipeline.replica),
        retained=retained,
        merge_pool=ThreadPoolExecutor(1),
        reject=Rejections(lambda result: None),
        on_merge=lambda result: None,
        on_event=lambda *a, **k: None,
        active=True,
    )
    evidence = Evidence(ctx)
    for sender, blob in pushes:
        await evidence.rpc_evidence(Info(sender), _stream(blob), None)
        await asyncio.gather(*network.tasks)
    ctx.merge_pool.shutdown()  # type: ignore[attr-defined]
    return {"rejections": ctx.reject.counts, "sent": network.sent}


def test_a_pushed_group_proof_is_settled_and_passed_on_once_to_the_others() -> None:
    pipeline = _pipeline()
    blob = _proof().to_bytes()
    end = asyncio.run(_push(pipeline, [("pusher", blob), ("other", blob)]))
    assert pipeline.replica.has_applied(*UID) and pipeline.equivocation.is_equivocated(UID)
    assert end["sent"] == [("other", "evidence", blob)]  # not back to its sender; once
    assert not end["rejections"]


def test_bad_group_proof_bytes_are_counted_against_their_sender() -> None:
    pipeline = _pipeline()
    blob = _proof().to_bytes()
    forged = blob[:-40] + bytes(40)
    pushes = [("pusher", forged), ("pusher", b"DLG1{}"), ("a-stranger", blob)]
    end = asyncio.run(_push(pipeline, pushes))
    assert end["rejections"] == {
        "evidence_malformed": 2,  # a cut signature hex, fields missing
        "evidence_unknown_peer": 1,
    }
    assert not pipeline.replica.has_applied(*UID) and not end["sent"]


def test_a_replica_without_groups_passes_no_group_proof_on() -> None:
    pipeline = _pipeline()
    pipeline.group_run = None
    assert pipeline.submit_group(A, lambda peer: True).accepted
    end = asyncio.run(_push(pipeline, [("pusher", _proof().to_bytes())]))
    assert not end["sent"] and not pipeline.equivocation.is_equivocated(UID)
