"""The adversary's protocol peer: a real node's network parts, hooked so that it serves and
signs what an attack chooses (bench.adversary runs the attack classes on it).

It joins a swarm the way a node does (a node.runtime.Node with the run's settings, so its
fingerprint, signed heartbeats, DHT records and libp2p streams are the real ones; it does not
train). :class:`AdversaryPeer` reads what the honest nodes say, seals and offers updates
under any of its keys, serves payloads and a poisoned state of its choosing, and signs DHT
records for its Sybil keys (:class:`SybilValidator`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import torch

import dht.network
from dht.heartbeat import Heartbeat
from dht.records import _OWNER_RE, _SIGNATURE_MARK, OwnerValidator, _serialize, owner_subkey
from dht.resumable import parse_part_request, part_answer
from dht.state_check import applied_digest
from dht.state_transfer import send_state
from dht.transport import (
    decode_request,
    receive_blob,
    send_blob,
    send_refusal,
)
from merge.codecs import get_codec
from merge.envelope import SignedUpdate, seal
from merge.identity import Identity
from node.cli import build_parser
from node.config import JoinConfig, config_from_args
from node.events import RecordingEventLog
from node.runtime import Node

logger = logging.getLogger("bench.adversary")
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


class AdversaryPeer:
    """A participant speaking the real protocol, through a real node's network parts."""

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
        # The adversary watches every live peer (a newcomer among its own Sybils included).
        self.swarm.membership.has_record = None

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
        if getattr(self, "member", False):  # group_lone_variant: in the honest groups' census
            return dataclasses.replace(own, state="training")
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


def build_node(peers: str, home: Path, run_args: list[str], sybils: list[Identity]) -> Node:
    keys = {s.peer_id: s for s in sybils}
    # The adversary's own DHT member signs for its Sybils (resolved when the swarm starts).
    dht.network.OwnerValidator = lambda identity, refusals=None: SybilValidator(identity, keys)  # type: ignore[assignment,misc]
    args = build_parser().parse_args(
        ["join", *run_args, "--peers", peers, "--host", "127.0.0.1", "--port", "0",
         "--identity", str(home / "id.key"), "--checkpoint-dir", str(home / "ckpt")]
    )  # fmt: skip
    node = Node(config_from_args(JoinConfig, args), RecordingEventLog())
    node.build_swarm()  # its parts are hooked (AdversaryPeer) before it joins
    return node
