"""What a node writes to `holders/AUTHOR` as it retains AUTHOR's updates
(dht.gossip_announce.Announcements.retain): one subkey of its own, rewritten at most once a
HOLDER_WRITE_PERIOD_S with what it retains now, however fast the author publishes. The DHT
is a recorder of stores here (reading them back through hivemind is tests/swarm's)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from dht import gossip_announce
from dht.catchup import CatchUp, CatchUpConfig
from dht.gossip_announce import Announcements
from dht.gossip_context import GossipContext
from dht.messages import holder_subkey, parse_holder
from dht.retention import RetainedUpdates
from dht.swarm_config import SwarmConfig
from merge.identity import Identity
from tests.factories import sealed_update

FLOODER, OTHER = Identity.generate(), Identity.generate()
PERIOD_S = 0.1


class RecordingDht:
    """The swarm network's config, peer id and background tasks; a DHT store is recorded
    (key, subkey, value) and takes `store_s`; the first `failures` stores raise."""

    def __init__(self, store_s: float = 0.02, failures: int = 0) -> None:
        self.config = SwarmConfig(
            run_id="r", fingerprint="ab" * 32, run_summary={}, identity_path=""
        )
        self.peer_id = Identity.generate().peer_id
        self.stores: list[tuple[str, str, Any]] = []
        self.store_s, self.failures = store_s, failures
        self.in_flight = self.most_in_flight = 0

    def spawn(self, coro: Any) -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(coro)

    async def dht_store(self, key: str, subkey: str, value: Any, ttl_s: float) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.store_s)
            if self.failures > 0:
                self.failures -= 1
                raise TimeoutError("the DHT did not answer")
            self.stores.append((key, subkey, value))
        finally:
            self.in_flight -= 1


def announcements(dht: RecordingDht) -> Announcements:
    network: Any = dht
    context = GossipContext(
        network=network,
        membership=None,  # type: ignore[arg-type]  # retain reads no heartbeats
        merge=None,  # type: ignore[arg-type]  # nor the merge
        catchup=CatchUp(CatchUpConfig(), dht.peer_id, None),  # type: ignore[arg-type]
        retained=RetainedUpdates(per_author=16, budget_bytes=1 << 20),
        merge_pool=None,  # type: ignore[arg-type]
        reject=None,  # type: ignore[arg-type]
        on_merge=lambda result: None,
        on_event=lambda *a, **k: None,
        active=True,
    )
    return Announcements(context, lambda header: None)


async def retain_flood(announce: Announcements, author: Identity, seqs: range) -> float:
    """Retains `seqs` of `author` as fast as they come; the seconds it took."""
    started = time.monotonic()
    for seq in seqs:
        await announce.retain(sealed_update(author, seq=seq))
    return time.monotonic() - started


async def settle(dht: RecordingDht) -> None:
    """Until the last write (PERIOD_S after the one before it) has been stored."""
    await asyncio.sleep(2 * PERIOD_S + 5 * dht.store_s)


def test_a_flood_of_one_author_costs_one_subkey_rewritten_once_a_period(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gossip_announce, "HOLDER_WRITE_PERIOD_S", PERIOD_S)
    dht = RecordingDht()

    async def run() -> float:
        announce = announcements(dht)
        elapsed = await retain_flood(announce, FLOODER, range(1, 201))
        await settle(dht)
        return elapsed

    elapsed = asyncio.run(run())
    key = f"{dht.config.prefix}/holders/{FLOODER.peer_id}"
    assert {(k, s) for k, s, _ in dht.stores} == {(key, holder_subkey(dht.peer_id))}
    assert len(dht.stores) <= 2 + elapsed / PERIOD_S < 200, "one write a period, not one an update"
    assert dht.most_in_flight == 1
    last = parse_holder(holder_subkey(dht.peer_id), dht.stores[-1][2])
    assert last.ranges == ((185, 200),), "the last write names what it retains after the flood"


def test_each_author_has_its_own_record_and_a_failed_store_costs_one_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gossip_announce, "HOLDER_WRITE_PERIOD_S", PERIOD_S)
    dht = RecordingDht(failures=1)

    async def run() -> None:
        announce = announcements(dht)
        await announce.retain(sealed_update(FLOODER, seq=1))  # its write fails
        await settle(dht)
        await retain_flood(announce, FLOODER, range(2, 4))
        await retain_flood(announce, OTHER, range(5, 6))
        await settle(dht)

    asyncio.run(run())
    written = {k.rsplit("/", 1)[1]: parse_holder(s, v).ranges for k, s, v in dht.stores}
    assert written == {FLOODER.peer_id: ((1, 3),), OTHER.peer_id: ((5, 5),)}
