"""A hostile participant that speaks the real protocol, built from this package's own classes.

It joins a swarm the way a node does (a node.runtime.Node with the run's settings, so its
fingerprint, signed heartbeats, DHT records and libp2p streams are the real ones; it does not
train), then runs attack classes one at a time against the honest nodes it finds, and after
each one reads what the honest nodes counted from their signed heartbeats (what
`diloco-node status` shows). One JSON event per line on stdout:

    {"event": "ready", "peer_id": ..., "honest": [...]}
    {"event": "attack", "attack": NAME, "sent": N, "rejected": {reason: n}, "by_node": {...},
     "rounds": {...}, "applied": {...}, "digests": {...}, "started_at": t0, "ended_at": t1}
    {"event": "poison_ready"}   (poisoned_state: start a newcomer now)
    {"event": "done"}

Usage: python -m bench.adversary --peers MADDR --home DIR [--attacks a,b] [--sybils N]
           [--settle S] [--duration S] [--until-round R] -- RUN_ARGS (the honest nodes' run
           flags: model, inner steps, ...)

Attack classes (ATTACKS): forged_header, wrong_shape, nan_inf, norm_1000x, against_direction,
replay, equivocation, oversized, notify_flood, sybil, bad_heartbeats, far_future,
mixed_subkeys, poisoned_state; and the patient ones of issue 20, which keep on for
--duration seconds or until every honest node reports --until-round: zero_flood,
summary_flood, sideways, sybil_learners, and sybil_vouchers (poisoned_state vouched for by
many Sybil heartbeats). Each class's docstring says what it sends.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

import dht.network
from dht.catchup import to_ranges
from dht.heartbeat import Heartbeat, sign_fields
from dht.messages import RUN_LISTING_KEY, announcement_subkey
from dht.records import _OWNER_RE, _SIGNATURE_MARK, OwnerValidator, _serialize, owner_subkey
from dht.resumable import parse_part_request, part_answer
from dht.state_check import applied_digest
from dht.state_transfer import send_state
from dht.transport import (
    decode_request,
    encode_request,
    receive_blob,
    send_blob,
    send_refusal,
)
from merge.codecs import get_codec
from merge.envelope import SignedHeader, SignedUpdate, seal
from merge.identity import Identity
from node.cli import build_parser
from node.config import JoinConfig, config_from_args
from node.events import JsonEventLog, RecordingEventLog
from node.runtime import Node

logger = logging.getLogger("bench.adversary")
TEN_YEARS_S = 10 * 365 * 86400
FLOOD_STREAMS = 64
"""Notify streams the flood keeps open at once."""
SYBIL_BATCH = 64
"""Sybil heartbeats stored at once."""
ZERO_PERIOD_S = 0.25
"""zero_flood: seconds between two all-zero updates (an honest node publishes one a round)."""
SIDEWAYS_POLL_S = 0.5
"""sideways: how often it looks whether the honest nodes started another round."""
SIDEWAYS_CAP_SHARE = 1.5
"""sideways: the update's norm as a share of the norm bound (max_norm_to_median x median, as
this node sees it): above 1, so that every receiver clips it to exactly its own bound."""
SIDEWAYS_COSINE_MARGIN = 0.1
"""sideways: the cosine to this node's momentum sits this far above the refusal bound
(min_cosine): at 0.05, half the updates fell below it on the honest replicas (their momentum
holds the sideways updates, this one's does not) and were zeroed."""
SUMMARY_PERIOD_S = 0.5
"""summary_flood: seconds between two rounds of summaries (one to each honest node)."""
SUMMARY_IDS = 1 << 20
"""summary_flood: update ids the applied ranges name, and the retained ones (the parser's cap)."""
SYBIL_LEARNERS = 40
"""sybil_learners: Sybil authors, each claiming LEARNER_CLAIM learners."""
LEARNER_CLAIM = 1024
SYBIL_UPDATE_PERIOD_S = 2.0
"""sybil_learners: seconds between two rounds of updates (one per Sybil author)."""
SYBIL_VOUCHERS = 8
"""sybil_vouchers: Sybil heartbeats vouching for the poisoned state (beside the accomplice)."""
UpdateId = tuple[str, int]


class SybilValidator(OwnerValidator):
    """The adversary's DHT member: signs owner records for every key it holds (its Sybils),
    signs records in other peers' names with a junk signature (honest members must refuse
    them), and keeps whatever it is sent."""

    def __init__(self, identity: Identity | None, keys: dict[str, Identity]) -> None:
        super().__init__(identity)
        self._keys = keys

    def validate(self, record: Any) -> bool:
        """Its own Sybils' records pass; anyone else's are checked as honest members check
        them (else its own view of the swarm would hold the junk it wrote)."""
        owners = set(_OWNER_RE.findall(record.subkey or b""))
        if len(owners) == 1 and owners.pop().decode() in self._keys:
            return True
        return super().validate(record)

    def sign_value(self, record: Any) -> bytes:
        owners = set(_OWNER_RE.findall(record.subkey or b""))
        if len(owners) != 1 or self._identity is None:
            return bytes(record.value)
        owner = owners.pop().decode()
        if owner == self._identity.peer_id:
            return super().sign_value(record)
        key = self._keys.get(owner)
        signature = key.sign(_serialize(record)) if key is not None else bytes(64)
        return bytes(record.value) + _SIGNATURE_MARK + signature


class Adversary:
    """Attacks on the honest nodes of a swarm, through a real node's network parts."""

    def __init__(
        self,
        node: Node,
        emit: Callable[..., None],
        sybils: list[Identity],
        accomplice: Identity | None = None,
        *,
        duration_s: float = 30.0,
        until_round: int | None = None,
    ) -> None:
        assert node.swarm is not None
        self.node = node
        self.swarm = node.swarm
        self.net = node.swarm.network
        self.emit = emit
        self.sybils = sybils
        self.accomplice = accomplice or Identity.generate()
        """A second key of the adversary's (its DHT member must sign for it: build_node)."""
        self.fake_ids = {s.peer_id for s in sybils} | {self.accomplice.peer_id}
        self.duration_s = duration_s
        """How long a patient class (zero_flood, sideways, ...) keeps on at most."""
        self.until_round = until_round
        """A patient class stops once every honest node reports this round (None: never)."""
        self.served: dict[UpdateId, dict[str | None, bytes]] = {}
        """Payloads this adversary serves, per requesting peer (None: anyone else)."""
        self.poison = False
        self.poisons_served = 0
        self._poisoned: dict[str, Any] | None = None
        """The noised state served while poisoning, fixed once (so a sketch can vouch for it)."""
        self._claim: tuple[int, str] = (0, "")
        """(num_applied, applied_digest) claimed while poisoning."""
        self._seq = 0
        self._original_stream_state = self.swarm.transfer._stream_state
        # Hooks on the real parts (registered as stream handlers when the swarm starts).
        self.swarm.gossip.rpc_update = self.rpc_update  # type: ignore[method-assign,assignment]
        self.swarm.transfer._stream_state = self.stream_state  # type: ignore[method-assign]
        self.swarm.membership._heartbeat_fn = self.heartbeat

    # ---- what the honest nodes say -------------------------------------------------------------

    def honest(self) -> list[Heartbeat]:
        own = {self.node.peer_id} | self.fake_ids
        return sorted(
            (h for h in self.swarm.alive_peers() if h.peer_id not in own), key=lambda h: h.peer_id
        )

    def wait_honest(self, count: int, min_applied: int, timeout_s: float) -> list[Heartbeat]:
        deadline = time.monotonic() + timeout_s
        while True:
            honest = self.honest()
            if len(honest) >= count and all(h.num_applied >= min_applied for h in honest):
                return honest
            if time.monotonic() > deadline:
                raise TimeoutError(f"honest nodes not ready: {[h.peer_id for h in honest]}")
            time.sleep(0.5)

    def observe(self) -> dict[str, Heartbeat]:
        return {h.peer_id: h for h in self.honest()}

    def observe_after(
        self, since: float, count: int, timeout_s: float = 30.0
    ) -> dict[str, Heartbeat]:
        """The honest nodes' heartbeats once `count` of them were sent after `since` (so their
        counters include what this class sent, however loaded the machine: heartbeats and this
        node's polls lag), or whatever is there after `timeout_s`."""
        time.sleep(max(since - time.time(), 0.0))
        deadline = time.monotonic() + timeout_s
        while True:
            after = self.observe()
            fresh = [h for h in after.values() if h.sent_at >= since]
            if len(fresh) >= count or time.monotonic() >= deadline:
                return after
            time.sleep(0.5)

    # ---- the real protocol -------------------------------------------------------------------

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        return self.net.call(coro, timeout_s)

    def next_seq(self) -> int:
        self._seq = max(self._seq, self.node.seq) + 1
        return self._seq

    def seal(
        self,
        payload: torch.Tensor | bytes,
        *,
        identity: Identity | None = None,
        seq: int | None = None,
        numel: int | None = None,
        codec: str = "fp32",
        created_at: float | None = None,
        learners: int | None = None,
    ) -> SignedUpdate:
        if isinstance(payload, torch.Tensor):
            payload = get_codec("fp32").encode(payload.float())
        applied = self.node.replica.num_applied
        return seal(
            identity or self.node.identity,
            fingerprint=self.node.fingerprint,
            seq=self.next_seq() if seq is None else seq,
            base_applied=applied,
            published_applied=applied,
            inner_steps=self.node.config.inner_steps,
            tokens=self.node.merge_config.token_weight.reference_tokens,
            loss=1.0,
            codec=codec,
            numel=self.node.num_params if numel is None else numel,
            payload=payload,
            created_at=created_at,
            learners=1 + len(self.honest()) if learners is None else learners,
        )

    def notify(self, peer_ids: list[str], blob: bytes) -> int:
        """Push `blob` on each peer's notify stream; how many streams took it."""

        async def push() -> list[object]:
            return await asyncio.gather(
                *(asyncio.wait_for(self.net.send(p, "notify", blob), 10.0) for p in peer_ids),
                return_exceptions=True,
            )

        return sum(not isinstance(r, BaseException) for r in self.call(push()))

    def offer(self, update: SignedUpdate, per_peer: dict[str | None, bytes] | None = None) -> int:
        """Serve `update` (or another payload per peer) and notify every honest node of it."""
        self.served[update.header.update_id] = {None: update.to_bytes(), **(per_peer or {})}
        return self.notify([h.peer_id for h in self.honest()], update.signed_header.to_bytes())

    async def rpc_update(self, info: Any, reader: Any, writer: Any) -> None:
        """The real handler's protocol; what it serves is the adversary's choice."""
        try:
            args = decode_request(await receive_blob(reader, max_bytes=4096)).get("args")
            uid, offset = parse_part_request(args)
            blobs = self.served.get(uid)
            if blobs is None:
                data = await asyncio.to_thread(self.swarm.gossip.retained.get, uid)
            else:
                data = blobs.get(str(info.peer_id), blobs[None])
            if data is None:
                await send_refusal(writer, "not held")
            else:
                await send_blob(writer, part_answer(data, offset))
        except Exception as exc:  # a hostile server does not care
            logger.debug("update request failed: %s", exc)
        finally:
            writer.close()

    def dht_store(self, key: str, subkey: str | int, value: object, ttl_s: float = 60.0) -> bool:
        try:
            self.call(self.net.dht_store(key, subkey, value, ttl_s), 30.0)
            return True
        except Exception as exc:
            logger.info("DHT store %s/%s failed: %s", key, subkey, exc)
            return False

    # ---- state served and heartbeat sent -------------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        """Idle (it is no learner the honest nodes size their steps by); when poisoning, it
        claims far more progress than anyone so that a newcomer picks it as donor."""
        own = self.node.heartbeat()
        if not self.poison:
            return dataclasses.replace(own, state="idle")
        num, digest = self._claim
        return dataclasses.replace(own, state="idle", num_applied=num, applied_digest=digest)

    def poison_state(self) -> None:
        """Noise the replica's params by their own norm, once; claim a thousand updates more
        than it holds, under its applied set."""
        state = self.node.replica.state_dict()
        params = state["params"]
        assert isinstance(params, torch.Tensor)
        noise = torch.randn(params.shape, generator=torch.Generator().manual_seed(7))
        state["params"] = params + noise.to(params.dtype) * params.norm() / params.numel() ** 0.5
        applied = state["applied"]
        assert isinstance(applied, dict)
        state["applied"] = applied = {a: list(seqs) for a, seqs in applied.items()}
        self._poisoned = state
        self._claim = (sum(map(len, applied.values())) + 1000, applied_digest(applied))

    def vouch(self, vouchers: list[Identity] | None = None) -> bool:
        """Heartbeats of other keys (the accomplice by default) reporting the poisoned claim
        and the poisoned state's sketch: the newcomer then sees the poisoner corroborated
        (asked first) and the exact same-applied-set check passes on the vouchers."""
        assert self._poisoned is not None
        num_applied, digest = self._claim
        sketch = self.node.sketcher.settled(self.node.replica, self._poisoned)
        key = f"{self.swarm.config.prefix}/peers"
        stored = 0
        for voucher in vouchers or [self.accomplice]:
            beat = Heartbeat(
                peer_id=voucher.peer_id, state="training", num_applied=num_applied,
                applied_digest=digest, serves_state=False, sent_at=time.time(),
                sketch=sketch, heartbeat_period_s=self.swarm.config.heartbeat_period_s,
            )  # fmt: skip
            stored += self.dht_store(key, owner_subkey(voucher.peer_id), beat.sign(voucher), 60.0)
        return stored > 0

    async def stream_state(self, writer: Any) -> int:
        if not self.poison or self._poisoned is None:
            return await self._original_stream_state(writer)
        num_bytes = await send_state(  # sealed with its own key: the seal checks out
            writer, self._poisoned, self.net.identity, self.swarm.config.fingerprint
        )
        self.poisons_served += 1
        return num_bytes

    # ---- payload material ----------------------------------------------------------------------

    def direction(self) -> torch.Tensor:
        """The swarm's training direction (the outer momentum of this node's replica), unit."""
        with self.node.replica.lock:
            momentum = self.node.replica.outer.momentum_direction()
            d = momentum.clone() if momentum is not None else torch.randn(self.node.num_params)
        return d / d.norm().clamp_min(1e-12)

    def typical_norm(self) -> float:
        with self.node.replica.lock:
            median = self.node.pipeline.robust.median_norm()
        return median if median is not None else 1e-3 * float(self.node.replica.params.norm())

    def benign(self, scale: float = 0.5) -> torch.Tensor:
        return self.direction() * scale * self.typical_norm()

    # ---- the attacks ---------------------------------------------------------------------------

    def forged_header(self) -> int:
        """Headers in an honest author's name signed by the attacker, and an own header changed
        after signing: on notify streams and as DHT announcements."""
        sent = 0
        honest = self.honest()
        for victim in honest:
            others = [h.peer_id for h in honest if h.peer_id != victim.peer_id]
            for ahead in (1, 2, 3):
                seq = victim.latest_seq + ahead
                mine = self.seal(self.benign(), seq=seq)
                header = dataclasses.replace(mine.header, author=victim.peer_id)
                blob = SignedHeader(header, mine.signature).to_bytes()
                sent += self.notify(others, blob)
                key = f"{self.swarm.config.prefix}/updates/{victim.peer_id}"
                # under the victim's own announcement subkey, with a junk record signature and
                # an expiration that outlives the real record
                sent += self.dht_store(key, announcement_subkey(victim.peer_id, seq), blob, 1e5)
        own = self.seal(self.benign())
        tampered = dataclasses.replace(own.header, loss=0.5)
        sent += self.notify(
            [h.peer_id for h in honest], SignedHeader(tampered, own.signature).to_bytes()
        )
        return sent

    def wrong_shape(self) -> int:
        """Valid signatures over a wrong element count, a payload of the wrong length, an
        unknown codec."""
        n = self.node.num_params
        sent = self.offer(self.seal(torch.zeros(n + 1), numel=n + 1))
        sent += self.offer(self.seal(torch.zeros(n - 1), numel=n))
        sent += self.offer(self.seal(bytes(4 * n), codec="int3"))
        return sent

    def nan_inf(self) -> int:
        sent = 0
        for bad in (float("nan"), float("inf"), -float("inf")):
            payload = self.benign()
            payload[len(payload) // 2] = bad
            sent += self.offer(self.seal(payload))
        return sent

    def norm_1000x(self) -> int:
        return self.offer(self.seal(self.direction() * 1000 * self.typical_norm()))

    def against_direction(self) -> int:
        """Near the norm bound (4x the median), pointed against the training direction."""
        sent = 0
        for _ in range(3):
            # 2.5x the median: inside the norm bound (4x) wherever the median is a little lower
            sent += self.offer(self.seal(-self.direction() * 2.5 * self.typical_norm()))
            time.sleep(0.5)
        return sent

    def replay(self) -> int:
        """Headers already merged, pushed again: an honest author's and the adversary's own."""
        sent = 0
        honest = [h.peer_id for h in self.honest()]
        for uid in self.swarm.gossip.retained.ids()[-4:]:
            data = self.swarm.gossip.retained.get(uid)
            if data is not None:
                sent += self.notify(honest, SignedUpdate.from_bytes(data).signed_header.to_bytes())
        for blobs in list(self.served.values())[-4:]:
            sent += self.notify(
                honest, SignedUpdate.from_bytes(blobs[None]).signed_header.to_bytes()
            )
        return sent

    def equivocation(self) -> int:
        """Two signed payloads under one update id, one per honest node; then each node is told
        of the payload the other one got."""
        honest = [h.peer_id for h in self.honest()]
        seq = self.next_seq()
        a = self.seal(self.benign(0.5), seq=seq)
        b = self.seal(self.benign(0.25), seq=seq)
        variants = [a, b]
        per_peer: dict[str | None, bytes] = {
            p: variants[i % 2].to_bytes() for i, p in enumerate(honest)
        }
        self.served[a.header.update_id] = {None: a.to_bytes(), **per_peer}
        sent = 0
        for i, peer in enumerate(honest):
            sent += self.notify([peer], variants[i % 2].signed_header.to_bytes())
        time.sleep(3 * self.swarm.config.heartbeat_period_s)  # both fetched and merged
        for i, peer in enumerate(honest):
            sent += self.notify([peer], variants[(i + 1) % 2].signed_header.to_bytes())
        return sent

    def oversized(self) -> int:
        """A header blob 16x the cap; payloads just over and far over the update size cap."""
        honest = [h.peer_id for h in self.honest()]
        blob = self.seal(self.benign()).signed_header.to_bytes()
        sent = self.notify(honest, blob + bytes(16 * 4096))
        n = self.node.num_params
        sent += self.offer(self.seal(bytes(4 * n + 1024)))
        sent += self.offer(self.seal(bytes(4 * n + (1 << 17))))
        return sent

    def notify_flood(self, count: int = 400) -> int:
        """Headers signed by fresh keys (none has a heartbeat), as fast as streams open."""
        honest = [h.peer_id for h in self.honest()]
        blobs = [
            self.seal(
                torch.zeros(4), identity=Identity.generate(), seq=1, numel=4
            ).signed_header.to_bytes()
            for _ in range(count)
        ]

        async def flood() -> list[object]:
            streams = asyncio.Semaphore(FLOOD_STREAMS)

            async def send(peer_id: str, blob: bytes) -> None:
                async with streams:
                    await asyncio.wait_for(self.net.send(peer_id, "notify", blob), 20.0)

            sends = [send(p, blob) for blob in blobs for p in honest]
            return await asyncio.gather(*sends, return_exceptions=True)

        return sum(not isinstance(r, BaseException) for r in self.call(flood(), 120.0))

    def sybil(self, duration_s: float = 10.0) -> int:
        """Every Sybil key keeps a valid signed heartbeat in the DHT (claiming to train, ahead
        in seq, with another applied set) for `duration_s`, refreshed as fast as it can."""
        key = f"{self.swarm.config.prefix}/peers"
        period = self.swarm.config.heartbeat_period_s
        deadline = time.monotonic() + duration_s
        sent = 0

        async def store_all(beats: list[tuple[Identity, bytes]]) -> int:
            stored = 0
            for i in range(0, len(beats), SYBIL_BATCH):  # one DHT call per record: small pipes
                stores = [
                    asyncio.wait_for(self.net.dht_store(key, owner_subkey(s.peer_id), b, 30.0), 30)
                    for s, b in beats[i : i + SYBIL_BATCH]
                ]
                results = await asyncio.gather(*stores, return_exceptions=True)
                stored += sum(not isinstance(r, BaseException) for r in results)
            return stored

        while time.monotonic() < deadline:
            beats = [
                (s, Heartbeat(peer_id=s.peer_id, state="training", latest_seq=5,
                              applied_digest="ab" * 32, sent_at=time.time(),
                              heartbeat_period_s=period).sign(s))
                for s in self.sybils[8:]
            ]  # fmt: skip
            sent += self.call(store_all(beats), 300.0)
        return sent

    def bad_heartbeats(self) -> int:
        """Mistyped heartbeats, one claiming an honest peer's id, one under a subkey that names
        no owner, and honest peers' records overwritten with a later expiration."""
        key = f"{self.swarm.config.prefix}/peers"
        honest = self.honest()
        victim = honest[0].peer_id
        mistyped: list[dict[str, object]] = [
            {"sketch": None},
            {"applied_digest": ["x"]},
            {"sent_at": "yesterday"},
            {"loss": 10**400},
            {"val_loss": 1e308},
            {"rejections": {str(i): i for i in range(1000)}},
        ]
        sent = 0
        for key_of, change in zip(self.sybils[:6], mistyped, strict=True):
            fields = dataclasses.asdict(Heartbeat(peer_id=key_of.peer_id, sent_at=time.time()))
            blob = sign_fields(fields | change, key_of)
            sent += self.dht_store(key, owner_subkey(key_of.peer_id), blob)
        claimer = self.sybils[6]
        claim = Heartbeat(peer_id=victim, sent_at=time.time() + 1000)
        blob = sign_fields(dataclasses.asdict(claim), claimer)
        sent += self.dht_store(key, owner_subkey(claimer.peer_id), blob)
        sent += self.dht_store(
            key, victim, Heartbeat(peer_id=self.sybils[7].peer_id).sign(self.sybils[7])
        )
        for h in honest:  # a later expiration, signed with junk (SybilValidator)
            junk = Heartbeat(peer_id=h.peer_id, state="idle", sent_at=time.time() + 1000)
            sent += self.dht_store(
                key, owner_subkey(h.peer_id), sign_fields(dataclasses.asdict(junk), claimer), 10**6
            )
        return sent

    def far_future(self) -> int:
        sent = self.offer(self.seal(self.benign(), seq=max(self.node.seq, 1) + 10**12))
        sent += self.offer(self.seal(self.benign(), created_at=time.time() + TEN_YEARS_S))
        return sent

    def mixed_subkeys(self) -> int:
        """Dictionary records whose subkeys mix int and str, where peers read them."""
        prefix = self.swarm.config.prefix
        victim = self.honest()[0].peer_id
        writes: list[tuple[str, str | int, object]] = [
            (f"{prefix}/updates/{victim}", "junk", b"x"),
            (f"{prefix}/updates/{self.node.peer_id}", "junk", b"x"),
            (f"{prefix}/peers", 12345, b"x"),
            (f"{prefix}/holders/{victim}", 7, True),
            (RUN_LISTING_KEY, 5, True),
            (f"diloco-run/{self.node.config.run_id}", 99, "x"),
        ]
        return sum(self.dht_store(k, s, v) for k, s, v in writes)

    def poisoned_state(self, wait_s: float = 150.0, vouchers: list[Identity] | None = None) -> int:
        """Serve a state with noised parameters while claiming the most progress; the harness
        starts a newcomer on `poison_ready`. Ends once the state was served, or once the
        newcomer holds a state from elsewhere (it asked corroborated donors first)."""
        before = {h.peer_id for h in self.honest()}
        self.poison_state()
        self.poison = True
        self.vouch(vouchers)
        time.sleep(2 * self.swarm.config.heartbeat_period_s)  # heartbeats carry the claim
        self.emit("poison_ready", peer_id=self.node.peer_id, accomplice=self.accomplice.peer_id)
        deadline = time.monotonic() + wait_s
        vouched = time.monotonic()
        while self.poisons_served == 0 and time.monotonic() < deadline:
            if any(h.peer_id not in before and h.num_applied > 0 for h in self.honest()):
                break  # the newcomer holds a state from elsewhere
            if time.monotonic() - vouched > self.swarm.config.heartbeat_period_s:
                self.vouch(vouchers)
                vouched = time.monotonic()
            time.sleep(0.5)
        time.sleep(2 * self.swarm.config.heartbeat_period_s)  # the newcomer tries the next donor
        self.poison = False
        return self.poisons_served

    # ---- patient attacks (issue 20): valid, signed, and kept up ---------------------------------

    def keep_up(self, act: Callable[[], int], period_s: float) -> int:
        """`act` once every `period_s` for `duration_s`, or until every honest node reports
        `until_round`; what it sent in all."""
        deadline = time.monotonic() + self.duration_s
        sent = 0
        while time.monotonic() < deadline and not self.honest_done():
            started = time.monotonic()
            sent += act()
            time.sleep(max(0.0, period_s - (time.monotonic() - started)))
        return sent

    def honest_done(self) -> bool:
        if self.until_round is None:
            return False
        honest = self.honest()
        return bool(honest) and all(h.round >= self.until_round for h in honest)

    def zero_flood(self) -> int:
        """Valid signed all-zero updates of one author (this one), four a second: each passes
        every check, and every one is a norm of 0 in the robust window's median."""
        zeros = torch.zeros(self.node.num_params)
        return self.keep_up(lambda: self.offer(self.seal(zeros)), ZERO_PERIOD_S)

    def sideways(self) -> int:
        """Updates at the norm cap (sent at SIDEWAYS_CAP_SHARE of it, clipped by each receiver
        to max_norm_to_median x its median) at a cosine to the momentum just above the refusal
        bound (min_cosine + margin), all along one fixed direction orthogonal to the momentum:
        never zeroed, and they add up instead of cancelling. One per honest round, an honest
        learner's pace: what a fair share of the merge lets through (a faster one is
        zero_flood's case, and at one a second it also drags the median up: 61x the clean
        loss in a 24-round run)."""
        robust = self.node.pipeline.robust.config
        cosine = min(robust.min_cosine + SIDEWAYS_COSINE_MARGIN, 1.0)
        generator = torch.Generator().manual_seed(11)
        side = torch.randn(self.node.num_params, generator=generator)
        published_at = [-1]

        def publish() -> int:
            honest_round = max((h.round for h in self.honest()), default=0)
            if honest_round <= published_at[0]:
                return 0
            published_at[0] = honest_round
            d = self.direction()
            across = side - (side @ d) * d
            across = across / across.norm().clamp_min(1e-12)
            unit = cosine * d + (1 - cosine**2) ** 0.5 * across
            norm = SIDEWAYS_CAP_SHARE * robust.max_norm_to_median * self.typical_norm()
            return self.offer(self.seal(unit * norm))

        return self.keep_up(publish, SIDEWAYS_POLL_S)

    def summary_flood(self) -> int:
        """Repair summaries of ~170 bytes naming 2^20 applied and 2^20 retained update ids
        (this node's, far ahead of what it published), sent to every honest node again and
        again within its summary budget: each one is walked id by id by the receiver."""
        first = self.next_seq() + 1000
        ids = [[first, first + SUMMARY_IDS - 1]]
        summary = encode_request(
            applied={self.node.peer_id: ids}, retained={self.node.peer_id: ids}
        )

        async def send_all() -> list[object]:
            sends = [
                self.net.exchange(p, "summary", summary, max_bytes=1 << 20, timeout_s=20.0)
                for p in [h.peer_id for h in self.honest()]
            ]
            return await asyncio.gather(*sends, return_exceptions=True)

        def send() -> int:
            return sum(not isinstance(r, BaseException) for r in self.call(send_all(), 60.0))

        self.emit("summary_bytes", num_bytes=len(summary))
        return self.keep_up(send, SUMMARY_PERIOD_S)

    def sybil_learners(self) -> int:
        """SYBIL_LEARNERS Sybil authors, each with a live signed heartbeat, publish valid small
        updates along the momentum claiming LEARNER_CLAIM learners each: the learner floor
        then sizes every honest update as a share of a far larger swarm. The updates are
        pushed by this node and offered in its repair summaries (a Sybil key has no host)."""
        authors = self.sybils[:SYBIL_LEARNERS]
        seqs = dict.fromkeys((s.peer_id for s in authors), 0)
        self._sybil_beats(authors, seqs)
        time.sleep(2 * self.swarm.config.heartbeat_period_s)  # honest nodes read them

        def publish() -> int:
            sent = 0
            for author in authors:
                seqs[author.peer_id] += 1
                update = self.seal(
                    self.benign(0.25), identity=author, seq=seqs[author.peer_id],
                    learners=LEARNER_CLAIM,
                )  # fmt: skip
                sent += self.offer(update)
            self._sybil_beats(authors, seqs)
            self._offer_summary({a: list(range(1, n + 1)) for a, n in seqs.items()})
            return sent

        return self.keep_up(publish, SYBIL_UPDATE_PERIOD_S)

    def sybil_vouchers(self, wait_s: float = 150.0) -> int:
        """poisoned_state, vouched for by SYBIL_VOUCHERS Sybil heartbeats beside the
        accomplice: in an open swarm the keys outnumber the honest trained peers whose
        sketches the newcomer compares the state with."""
        vouchers = [self.accomplice, *self.sybils[:SYBIL_VOUCHERS]]
        return self.poisoned_state(wait_s, vouchers)

    def _sybil_beats(self, authors: list[Identity], seqs: dict[str, int]) -> int:
        """A training heartbeat of each Sybil author, naming the seq it published last."""
        key = f"{self.swarm.config.prefix}/peers"
        period = self.swarm.config.heartbeat_period_s

        async def store_all() -> list[object]:
            stores = [
                self.net.dht_store(
                    key, owner_subkey(a.peer_id),
                    Heartbeat(peer_id=a.peer_id, state="training", latest_seq=seqs[a.peer_id],
                              updates_published=seqs[a.peer_id], sent_at=time.time(),
                              heartbeat_period_s=period).sign(a),
                    4 * period,
                )
                for a in authors
            ]  # fmt: skip
            return await asyncio.gather(*stores, return_exceptions=True)

        return sum(not isinstance(r, BaseException) for r in self.call(store_all(), 60.0))

    def _offer_summary(self, held: dict[str, list[int]]) -> int:
        """A repair summary to every honest node: `held` applied here and retained."""
        ranges = to_ranges(held)
        blob = encode_request(applied=ranges, retained=ranges)

        async def send_all() -> list[object]:
            sends = [
                self.net.exchange(p, "summary", blob, max_bytes=1 << 20, timeout_s=20.0)
                for p in [h.peer_id for h in self.honest()]
            ]
            return await asyncio.gather(*sends, return_exceptions=True)

        return sum(not isinstance(r, BaseException) for r in self.call(send_all(), 60.0))

    # ---- one class at a time ---------------------------------------------------------------------

    def run(self, name: str, settle_s: float) -> None:
        before = self.observe()
        started = time.time()
        try:
            sent = int(getattr(self, name)())
            error = None
        except Exception as exc:  # report and carry on with the next class
            logger.exception("attack %s failed", name)
            sent, error = 0, f"{type(exc).__name__}: {exc}"
        after = self.observe_after(time.time() + settle_s, len(before))
        by_node: dict[str, dict[str, int]] = {}
        total: Counter[str] = Counter()
        for peer_id, beat in after.items():
            old = before[peer_id].rejections if peer_id in before else {}
            delta = {r: n - old.get(r, 0) for r, n in beat.rejections.items() if n > old.get(r, 0)}
            by_node[peer_id] = delta
            total.update(delta)
        self.emit(
            "attack",
            attack=name,
            sent=sent,
            error=error,
            rejected=dict(total),
            by_node=by_node,
            rounds={p: h.round for p, h in after.items()},
            rounds_before={p: h.round for p, h in before.items()},
            applied={p: h.num_applied for p, h in after.items()},
            digests={p: h.applied_digest for p, h in after.items()},
            val_loss={p: h.val_loss for p, h in after.items()},
            drift={p: h.drift for p, h in after.items()},
            started_at=round(started, 3),
            ended_at=round(time.time(), 3),
        )


ATTACKS = (
    "forged_header", "wrong_shape", "nan_inf", "norm_1000x", "against_direction", "replay",
    "equivocation", "oversized", "notify_flood", "bad_heartbeats", "far_future",
    "mixed_subkeys", "poisoned_state", "sybil",
    "zero_flood", "summary_flood", "sideways", "sybil_learners", "sybil_vouchers",
)  # fmt: skip
"""Every attack class, in the order they run by default (the swarm-wide ones last)."""
PATIENT = ("zero_flood", "summary_flood", "sideways", "sybil_learners", "sybil_vouchers")
"""The classes of issue 20: updates and messages that pass every check, kept up."""
NEWCOMER_CLASSES = ("poisoned_state", "sybil_vouchers")
"""Classes that need a newcomer joining (started by the harness on `poison_ready`)."""


def build_node(peers: str, home: Path, run_args: list[str], sybils: list[Identity]) -> Node:
    keys = {s.peer_id: s for s in sybils}
    # The adversary's own DHT member signs for its Sybils (resolved when the swarm starts).
    dht.network.OwnerValidator = lambda identity, refusals=None: SybilValidator(identity, keys)  # type: ignore[assignment,misc]
    args = build_parser().parse_args(
        ["join", *run_args, "--peers", peers, "--host", "127.0.0.1", "--port", "0",
         "--identity", str(home / "id.key"), "--checkpoint-dir", str(home / "ckpt")]
    )  # fmt: skip
    return Node(config_from_args(JoinConfig, args), RecordingEventLog())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", required=True)
    parser.add_argument("--home", required=True, type=Path)
    parser.add_argument("--attacks", default=",".join(ATTACKS))
    parser.add_argument("--sybils", type=int, default=1000, help="fake identities (>= 8)")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after each attack")
    parser.add_argument("--honest", type=int, default=2, help="honest nodes to wait for")
    parser.add_argument("--min-applied", type=int, default=6)
    parser.add_argument(
        "--duration", type=float, default=30.0, help="seconds a patient class keeps on at most"
    )
    parser.add_argument(
        "--until-round", type=int, help="a patient class stops once every honest node is here"
    )
    parser.add_argument("run_args", nargs="*")
    args = parser.parse_args(argv)
    attacks = [a for a in args.attacks.split(",") if a]
    unknown = sorted(set(attacks) - set(ATTACKS))
    if unknown:
        parser.error(f"unknown attacks {unknown}; choose from {', '.join(ATTACKS)}")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    events = JsonEventLog()
    sybils = [Identity.generate() for _ in range(max(args.sybils, 8))]
    accomplice = Identity.generate()
    args.home.mkdir(parents=True, exist_ok=True)
    node = build_node(args.peers, args.home, args.run_args, [*sybils, accomplice])
    adversary = Adversary(
        node, events.emit, sybils, accomplice, duration_s=args.duration,
        until_round=args.until_round,
    )  # fmt: skip
    try:
        node.join_swarm()
        honest = adversary.wait_honest(args.honest, args.min_applied, 180.0)
        events.emit("ready", peer_id=node.peer_id, honest=[h.peer_id for h in honest])
        for name in attacks:
            adversary.run(name, args.settle)
        events.emit("done")
    finally:
        with contextlib.suppress(Exception):
            node.swarm.shutdown()  # type: ignore[union-attr]
        node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
