"""State transfer: a newcomer downloads the replica of the most advanced live peer, with what
judges its updates (merge.handover)."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import asdict, dataclass
from typing import Any

import blake3

from dht.budget import StreamLimits
from dht.heartbeat import Heartbeat
from dht.membership import Membership
from dht.merge_port import MergePort
from dht.messages import (
    MAX_SEAL_BYTES,
    MAX_STATE_META_BYTES,
    StateSeal,
    parse_state_manifest,
    parse_state_seal,
)
from dht.network import SwarmNetwork
from dht.reachability import path_rank
from dht.rejections import Rejections
from dht.resumable import PART_BYTES, fetch_resumable, parse_offset, part_answer
from dht.state_check import (
    StateCheckError,
    StateVerdict,
    applied_digest,
    check_donor_state,
    rank_donors,
)
from dht.state_donors import (
    DonorLook,
    JoinDownload,
    Skipped,
    Wait,
    in_group,
    look,
    own_group,
    spread_key,
)
from dht.state_parts import SerializedStates, parse_transfer_id, serialized_state
from dht.state_refusal import BUSY, StateRefusal, classify_failure
from dht.swarm_config import MIN_LINK_BYTES_PER_S, REQUEST_READ_TIMEOUT_S
from dht.tensor_stream import (
    DTYPES,
    TensorSpec,
    join_tensors,
    receive_tensor,
    send_tensor,
    split_tensors,
    tensor_spec,
)
from dht.transfer_progress import ProgressReport, TransferProgress
from dht.transport import (
    TransportError,
    decode_request,
    receive_blob,
    send_blob,
    send_refusal,
)
from merge.identity import Identity
from merge.sketch import ReplicaSketch, StateSketch

logger = logging.getLogger(__name__)
STATE_RATE_PER_S = 0.1
"""State downloads a peer may start per second (an honest newcomer asks once)."""
STATE_BURST = 3.0
STATE_PART_LIMITS = StreamLimits(rate_per_s=20.0, burst=256.0, max_in_flight=2, deadline_s=60.0)
"""Part requests a newcomer may send (a relayed download takes one per ~100 KiB)."""
DONOR_DIALS = 2
"""Failed dials in a row before a donor no stream has reached is left for the next one
(dht.resumable: behind NAT, a relayed address whose slot is gone never dials)."""
STATE_RECHECKS = 2
"""Fresh heartbeat reads before a state the live peers contradict is refused: a heartbeat
announces its author's updates up to a period late, and a donor's state is newer than it."""


@dataclass(frozen=True)
class TransferStats:
    num_bytes: int
    seconds: float
    peer_id: str
    unannounced: int = 0
    """Update ids in the loaded state above what their authors' heartbeats announced
    (dht.state_check.StateVerdict): kept, reported."""
    agreed_by: str = ""
    """How the peers at the state's applied set agreed with it (StateVerdict.agreed_by)."""

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / 1e6 / max(self.seconds, 1e-9)


class StateTransfer:
    """Serves this node's replica to newcomers and downloads one when joining."""

    def __init__(
        self,
        network: SwarmNetwork,
        membership: Membership,
        pipeline: MergePort,
        *,
        merge_pool: Executor,
        reject: Rejections,
        on_event: Callable[..., None] = lambda event, **fields: None,
    ) -> None:
        self.network = network
        self._on_event = on_event
        self.progress: ProgressReport | None = None
        """The running state download's progress, for the dashboard (None: none running)."""
        self.config = network.config
        self.membership = membership
        self.pipeline = pipeline
        self.replica = replica = pipeline.replica
        self._merge_pool = merge_pool
        self._reject = reject
        self._num_serving = 0
        self._sketch = ReplicaSketch(replica.numel, network.config.fingerprint)
        self.join_patience_s: float | None = None
        """How long a join keeps trying donors busy or out of reach (None: JoinDownload's)."""
        self._states = SerializedStates(network.config.max_state_streams)
        """Sealed states being downloaded in parts (dht.state_parts)."""

    async def register(self) -> None:
        limits = StreamLimits(
            rate_per_s=STATE_RATE_PER_S,
            burst=STATE_BURST,
            max_in_flight=1,
            deadline_s=self._transfer_timeout_s,
        )
        await self.network.add_handler("state", self.rpc_state, limits)
        await self.network.add_handler("state_part", self.rpc_state_part, STATE_PART_LIMITS)

    @property
    def _transfer_timeout_s(self) -> float:
        return 30.0 + self.config.max_state_bytes / MIN_LINK_BYTES_PER_S

    async def rpc_state(self, info: Any, reader: Any, writer: Any) -> None:
        """Serve this replica (the stream's deadline and closing: SwarmNetwork)."""
        try:
            await asyncio.wait_for(receive_blob(reader, max_bytes=4096), REQUEST_READ_TIMEOUT_S)
            if not self.config.serve_state:
                await send_refusal(writer, "this node does not serve state")
            elif self._num_serving >= self.config.max_state_streams:
                await send_refusal(writer, BUSY)
            else:
                self._num_serving += 1
                try:
                    num_bytes = await self._stream_state(writer)
                finally:
                    self._num_serving -= 1
                logger.info("served replica state (%.1f MB) to %s", num_bytes / 1e6, info.peer_id)
        except (TransportError, OSError, TimeoutError) as exc:
            logger.debug("state request failed: %s", exc)

    async def rpc_state_part(self, info: Any, reader: Any, writer: Any) -> None:
        """Serve a part of a sealed state, serialized on the download's first request
        (dht.state_parts; the stream's deadline and closing: SwarmNetwork)."""
        try:
            request = await asyncio.wait_for(
                receive_blob(reader, max_bytes=4096), REQUEST_READ_TIMEOUT_S
            )
            args = decode_request(request).get("args")
            transfer_id, offset = parse_transfer_id(args), parse_offset(args)
            if not self.config.serve_state:
                await send_refusal(writer, "this node does not serve state")
                return
            key = (str(info.peer_id), transfer_id)
            blob = await serialized_state(self._states, key, self._stream_state)
            if blob is None:
                await send_refusal(writer, BUSY)
            else:
                await send_blob(writer, part_answer(blob, offset))
                self._states.served(key, offset + PART_BYTES)
        except (TransportError, OSError, TimeoutError, ValueError) as exc:
            logger.debug("state part request failed: %s", exc)

    async def _stream_state(self, writer: Any) -> int:
        """The replica and what judges its updates (merge.handover) as a JSON tree followed
        by its tensors' raw bytes, chunk by chunk.

        One consistent copy is taken (under the replica's lock, off the loop); nothing is
        serialized as a whole.
        """
        state = await asyncio.get_running_loop().run_in_executor(None, self.pipeline.transfer_state)
        return await send_state(writer, state, self.network.identity, self.config.fingerprint)

    async def download(self) -> TransferStats | Skipped:
        """Replace the replica with the most advanced live peer's, if any peer is ahead;
        donors busy or out of reach are tried again for a bounded time, and a download that
        does not happen says why (dht.state_donors.JoinDownload)."""
        plan = JoinDownload(
            started_at=time.monotonic(),
            period_s=self.config.heartbeat_period_s,
            expects_peers=bool(self.config.initial_peers),
            patience_s=self.join_patience_s,
        )
        while True:
            step = plan.next(await self._look(), time.monotonic())
            if isinstance(step, Skipped):
                # a first node (no peers given) downloads from nobody by design: said in the
                # event only, not in a line that reads like a failure on a founder's screen
                logger.log(logging.INFO if plan.expects_peers else logging.DEBUG, "%s", step.line)
                return step
            if isinstance(step, Wait):
                await asyncio.sleep(step.seconds)
                await self.membership.poll()
                continue
            for donor in step.donors:
                try:
                    return await self._download_from(donor)
                except Exception as exc:  # an untrusted donor: try the next one
                    plan.failed(self._refused(donor, exc))
            await asyncio.sleep(plan.pause_s())  # every donor failed: bounded by the plan
            await self.membership.poll()

    async def _look(self) -> DonorLook:
        """What the peers' heartbeats say now, for JoinDownload."""
        alive = self.membership.alive_peers()
        live = {h.peer_id for h in alive}
        silent = [v.heartbeat for v in list(self.membership.peers.values())]
        silent = [h for h in silent if h.peer_id not in live]
        return look(alive, silent, self.replica.num_applied, await self._donors(alive))

    async def realign(self, peer_id: str) -> TransferStats | StateRefusal:
        """Replace the replica with `peer_id`'s (dht.realign chose it) through the newcomer's
        path: sealed, checked against fresh heartbeats, adopted all or nothing. A StateRefusal
        when it loaded nothing: a state to refuse is counted as `bad_state` against the donor,
        a busy, broken or timed-out stream is only logged; never raises for what the donor
        sent."""
        try:
            return await self._download_from(peer_id)
        except Exception as exc:  # an untrusted donor: counted, never the node
            return self._refused(peer_id, exc)

    def _refused(self, peer_id: str, exc: Exception) -> StateRefusal:
        refusal = classify_failure(peer_id, exc)
        if refusal.reason == "bad_state":
            self._reject("bad_state", peer_id, f"{refusal.check}: {refusal.detail}")
        logger.info("state of %s loaded nothing (%s, %s): %s", peer_id, refusal.reason,
                    refusal.check, refusal.detail)  # fmt: skip
        return refusal

    async def _download_from(self, peer_id: str) -> TransferStats:
        """Bounded: a donor that stalls is cut after REQUEST_READ_TIMEOUT_S without a byte,
        and the whole transfer after its deadline; the stream is closed however it ends."""
        started = time.perf_counter()
        async with asyncio.timeout(self._transfer_timeout_s):
            state, total = await self._receive_state(peer_id)  # sealed by the donor, checked
        verdict = await self._check_state(state, peer_id)
        await asyncio.get_running_loop().run_in_executor(
            self._merge_pool, self.pipeline.adopt, state
        )
        if verdict.unannounced:
            logger.info(
                "loaded the state of %s; %d update ids in it are above what their authors' "
                "heartbeats announced: %s",
                peer_id,
                verdict.num_unannounced,
                {a: (s[0], s[-1], len(s)) for a, s in verdict.unannounced.items()},
            )
        elapsed = time.perf_counter() - started
        return TransferStats(total, elapsed, peer_id, verdict.num_unannounced, verdict.agreed_by)

    async def _check_state(self, state: dict[str, Any], donor: str) -> StateVerdict:
        return await check_with_fresh_heartbeats(
            state,
            donor,
            self.membership.alive_peers,
            self.membership.poll,
            lambda state: self._sketch.of_state(self.replica, state),
            period_s=self.config.heartbeat_period_s,
        )

    async def _receive_state(self, peer_id: str) -> tuple[dict[str, Any], int]:
        """The donor's sealed state, in as many streams as the path needs (a relayed one is
        cut every ~128 KiB: dht.resumable), then checked as one stream (receive_state)."""
        progress = TransferProgress(peer_id, time.monotonic())

        def arrived(num_bytes: int, total: int) -> None:
            now = time.monotonic()
            progress.update(num_bytes, total, now)
            self.progress = report = progress.report(now)
            if progress.due(now):  # a long download: bytes, rate, ETA every few seconds
                self._on_event("state_progress", line=report.line(), **asdict(report))

        try:
            blob, num_attempts = await fetch_resumable(
                lambda: self.network.open_stream(peer_id, "state_part"),
                [secrets.token_hex(8)],
                max_bytes=self.config.max_state_bytes + MAX_STATE_META_BYTES + MAX_SEAL_BYTES + 64,
                stall_timeout_s=REQUEST_READ_TIMEOUT_S,
                on_progress=arrived,
                max_dial_failures=DONOR_DIALS,
            )
        finally:
            self.progress = None
        logger.info("state of %s: %d bytes in %d streams", peer_id, len(blob), num_attempts)
        reader = asyncio.StreamReader()
        reader.feed_data(blob)
        reader.feed_eof()
        return await receive_state(
            reader,
            peer_id,
            fingerprint=self.config.fingerprint,
            max_state_bytes=self.config.max_state_bytes,
        )

    async def _donors(self, alive: list[Heartbeat]) -> list[Heartbeat]:
        """Peers ahead of us that serve state: members of this node's learner group first
        (when groups are on), then corroborated, and within that those this node holds a
        direct connection to, then a relayed one (dht.state_check.rank_donors)."""
        await self.network.read_paths()  # p2pd's connections now, not a heartbeat period ago
        me, run_id = self.network.identity.peer_id, self.config.run_id
        return rank_donors(
            alive,
            self.replica.num_applied,
            path_rank=lambda peer: path_rank(self.network.paths.path(peer)),
            prefer=in_group(run_id, own_group(run_id, me, alive)),
            spread=lambda donor: spread_key(me, donor),
        )


async def send_state(
    writer: Any, state: dict[str, Any], identity: Identity, fingerprint: str
) -> int:
    """`state` (a replica's state_dict, with more) as a JSON tree followed by its tensors'
    raw bytes, chunk by chunk, then `identity`'s seal over those bytes and the applied set
    they hold (dht.messages.StateSeal); bytes sent."""
    tree, tensors = split_tensors(state)
    meta = json.dumps({"tree": tree, "tensors": [tensor_spec(t) for t in tensors]}).encode()
    hasher = blake3.blake3(meta)
    await send_blob(writer, meta)
    num_bytes = len(meta)
    for tensor in tensors:
        num_bytes += await send_tensor(writer, tensor, hasher)
    seal = StateSeal(
        fingerprint=fingerprint, donor=identity.peer_id, num_bytes=num_bytes,
        state_blake3=hasher.hexdigest(), num_applied=state["num_applied"],
        applied_digest=applied_digest(state["applied"]),
    ).sign(identity)  # fmt: skip
    await send_blob(writer, seal)
    return num_bytes + len(seal)


async def receive_state(
    reader: Any,
    donor: str,
    *,
    fingerprint: str,
    max_state_bytes: int,
    read_timeout_s: float = REQUEST_READ_TIMEOUT_S,
) -> tuple[dict[str, Any], int]:
    """What send_state sent, and its size: the manifest parsed strictly (dht.messages) before
    a tensor is allocated, every byte hashed as it arrives, and the seal checked (signed by
    `donor`, over those bytes and the applied set they hold). MessageError or
    StateCheckError for a state to refuse, TransportError or TimeoutError for a stream that
    failed."""
    head = await receive_blob(
        reader, max_bytes=MAX_STATE_META_BYTES, stall_timeout_s=read_timeout_s
    )
    manifest = parse_state_manifest(head, max_state_bytes=max_state_bytes)
    hasher = blake3.blake3(head)
    tensors = [
        await receive_tensor(
            reader,
            TensorSpec(DTYPES[t.dtype], tuple(t.shape)),
            read_timeout_s=read_timeout_s,
            hasher=hasher,
        )
        for t in manifest.tensors
    ]
    try:
        blob = await receive_blob(reader, max_bytes=MAX_SEAL_BYTES, stall_timeout_s=read_timeout_s)
    except TransportError as exc:
        raise StateCheckError(
            f"the state came without its donor's seal ({exc})", check="seal"
        ) from None
    seal = parse_state_seal(blob, donor=donor)
    state = join_tensors(manifest.tree, tensors)
    if not isinstance(state, dict):
        raise StateCheckError("the state is not a mapping", check="seal")
    total = len(head) + manifest.num_bytes
    check_seal(seal, state, fingerprint, total, hasher.hexdigest())
    return state, total


def check_seal(
    seal: StateSeal, state: Mapping[str, Any], fingerprint: str, num_bytes: int, blake3_hex: str
) -> None:
    """StateCheckError unless the donor's seal covers the bytes received (`num_bytes`, their
    BLAKE3 `blake3_hex`) and the applied set the state holds, in this run."""
    if seal.fingerprint != fingerprint:
        raise StateCheckError("the state is sealed for another run", check="seal")
    if (seal.num_bytes, seal.state_blake3) != (num_bytes, blake3_hex):
        raise StateCheckError(
            "the state's bytes do not hash to what its donor sealed", check="seal"
        )
    applied = state.get("applied")
    if not isinstance(applied, Mapping) or not all(
        isinstance(seqs, list) for seqs in applied.values()
    ):
        raise StateCheckError("the state lacks its applied set", check="seal")
    sealed = (seal.num_applied, seal.applied_digest)
    if sealed != (state.get("num_applied"), applied_digest(applied)):
        raise StateCheckError(
            "the state's applied set is not the one its donor sealed", check="seal"
        )


async def check_with_fresh_heartbeats(
    state: dict[str, Any],
    donor: str,
    alive_peers: Callable[[], list[Heartbeat]],
    poll: Callable[[], Awaitable[object]],
    sketch: Callable[[Mapping[str, object]], StateSketch],
    *,
    period_s: float,
    rechecks: int = STATE_RECHECKS,
) -> StateVerdict:
    """check_donor_state against the live peers' heartbeats, read again (`period_s` apart) up to
    `rechecks` times while they contradict the state: with rounds shorter than a heartbeat
    period, an honest donor's state holds its own update that its last heartbeat does not
    announce yet. StateCheckError once fresh heartbeats still contradict it."""
    for _ in range(rechecks):
        try:
            return check_donor_state(state, donor, alive_peers(), sketch)
        except StateCheckError as exc:
            logger.info("state of %s contradicted (%s); reading heartbeats again", donor, exc)
            await asyncio.sleep(period_s)
            await poll()
    return check_donor_state(state, donor, alive_peers(), sketch)
