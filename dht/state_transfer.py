"""State transfer: a newcomer downloads the replica of the most advanced live peer."""

from __future__ import annotations

import asyncio
import io
import logging
import time
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from dht.heartbeat import Heartbeat
from dht.membership import Membership
from dht.network import Rejections, SwarmNetwork
from dht.transport import TransportError, receive_blob, send_blob, send_refusal
from merge.replica import Replica

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferStats:
    num_bytes: int
    seconds: float
    peer_id: str

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / 1e6 / max(self.seconds, 1e-9)


class StateTransfer:
    """Serves this node's replica to newcomers and downloads one when joining."""

    def __init__(
        self,
        network: SwarmNetwork,
        membership: Membership,
        replica: Replica,
        *,
        merge_pool: Executor,
        reject: Rejections,
    ) -> None:
        self.network = network
        self.config = network.config
        self.membership = membership
        self.replica = replica
        self._merge_pool = merge_pool
        self._reject = reject

    async def register(self) -> None:
        await self.network.add_handler("state", self.rpc_state)

    async def rpc_state(self, info: Any, reader: Any, writer: Any) -> None:
        try:
            await receive_blob(reader, max_bytes=4096)
            if not self.config.serve_state:
                await send_refusal(writer, "this node does not serve state")
                return
            loop = asyncio.get_running_loop()
            blob = await loop.run_in_executor(None, self._state_blob)
            await send_blob(writer, blob)
            logger.info("served replica state (%.1f MB) to %s", len(blob) / 1e6, info.peer_id)
        except (TransportError, OSError) as exc:
            logger.debug("state request failed: %s", exc)
        finally:
            writer.close()

    def _state_blob(self) -> bytes:
        buffer = io.BytesIO()
        torch.save(self.replica.state_dict(), buffer)
        return buffer.getvalue()

    async def download(self) -> TransferStats | None:
        """Replace the replica with the most advanced live peer's, if any peer is ahead."""
        deadline = time.monotonic() + 2 * self.config.heartbeat_period_s + 2
        while (
            not self.membership.peers and self.config.initial_peers and time.monotonic() < deadline
        ):
            await self.membership.poll()
            await asyncio.sleep(0.2)
        for donor in self._donors():
            started = time.perf_counter()
            try:
                limit = self.config.max_state_bytes
                blob = await self.network.request(donor.peer_id, "state", limit)
                state = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
                await asyncio.get_running_loop().run_in_executor(
                    self._merge_pool, self.replica.load_state_dict, state
                )
            except Exception as exc:  # an untrusted donor: try the next one
                self._reject("bad_state", donor.peer_id, str(exc))
                continue
            return TransferStats(len(blob), time.perf_counter() - started, donor.peer_id)
        return None

    def _donors(self) -> list[Heartbeat]:
        """Peers ahead of us that serve state, most advanced first; majority digest preferred."""
        alive = self.membership.alive_peers()
        ahead = [h for h in alive if h.serves_state and h.num_applied > self.replica.num_applied]
        votes = Counter((h.num_applied, h.applied_digest) for h in alive)
        return sorted(
            ahead,
            key=lambda h: (h.num_applied, votes[(h.num_applied, h.applied_digest)]),
            reverse=True,
        )
