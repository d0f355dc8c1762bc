"""Signed heartbeats: what every node tells the swarm about itself, every few seconds."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from merge.identity import Identity, verify_signature

MAGIC = b"DHB1"
MAX_BODY_BYTES = 16 * 1024
SIGNATURE_BYTES = 64
STATES = ("syncing", "training", "idle")
MAX_AUTHORS = 128
"""Authors listed in `merged_by_author` (those with the most merged updates first)."""
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32)
"""Lower edges of the staleness histogram's buckets: 0, 1, 2-3, 4-7, 8-15, 16-31, 32+."""


def staleness_bucket(staleness: int) -> int:
    """Index of the `STALENESS_BUCKETS` bucket that holds `staleness`."""
    return max(i for i, edge in enumerate(STALENESS_BUCKETS) if staleness >= edge)


class HeartbeatError(ValueError):
    """A heartbeat that is malformed or not signed by the peer it claims to come from."""


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    peer_id: str
    org: str = ""
    version: str = ""
    device: str = ""
    memory_gb: float = 0.0
    state: str = "training"
    round: int = 0
    tokens_per_s: float = 0.0
    loss: float | None = None
    val_loss: float | None = None
    num_applied: int = 0
    applied_digest: str = ""
    latest_seq: int = 0
    updates_published: int = 0
    updates_merged: int = 0
    staleness_mean: float = 0.0
    drift: float | None = None
    sketch: list[float] = field(default_factory=list)
    uptime_s: float = 0.0
    maddrs: list[str] = field(default_factory=list)
    serves_state: bool = True
    rejections: dict[str, int] = field(default_factory=dict)
    sent_at: float = 0.0
    merged_by_author: dict[str, int] = field(default_factory=dict)
    """Updates of each author in this replica's applied set (at most MAX_AUTHORS authors)."""
    staleness_histogram: list[int] = field(default_factory=list)
    """Updates this node merged since it started, counted per STALENESS_BUCKETS bucket."""
    heartbeat_period_s: float = 0.0
    """The sender's heartbeat period: observers call it dead after three silent periods."""

    def sign(self, identity: Identity) -> bytes:
        if identity.peer_id != self.peer_id:
            raise ValueError("a heartbeat must be signed by the peer it describes")
        body = json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))
        raw = body.encode()
        return MAGIC + struct.pack(">I", len(raw)) + raw + identity.sign(raw)

    @classmethod
    def verify(cls, blob: object, expected_peer_id: str) -> Heartbeat:
        """Parse an untrusted blob; HeartbeatError unless `expected_peer_id` signed it."""
        if not isinstance(blob, bytes) or len(blob) < 8 or blob[:4] != MAGIC:
            raise HeartbeatError("not a heartbeat")
        (length,) = struct.unpack(">I", blob[4:8])
        if length > MAX_BODY_BYTES or len(blob) != 8 + length + SIGNATURE_BYTES:
            raise HeartbeatError("heartbeat has a wrong length")
        raw, signature = blob[8 : 8 + length], blob[8 + length :]
        if not verify_signature(expected_peer_id, raw, signature):
            raise HeartbeatError("heartbeat signature does not match its peer id")
        try:
            fields = json.loads(raw)
            heartbeat = cls(**fields)
        except (ValueError, TypeError) as exc:
            raise HeartbeatError(f"malformed heartbeat ({exc})") from None
        heartbeat._check(expected_peer_id)
        return heartbeat

    def _check(self, expected_peer_id: str) -> None:
        if self.peer_id != expected_peer_id:
            raise HeartbeatError("heartbeat names another peer")
        if self.state not in STATES:
            raise HeartbeatError(f"unknown state {self.state!r}")
        for name in ("round", "num_applied", "latest_seq", "updates_published", "updates_merged"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise HeartbeatError(f"{name} must be a non-negative integer")
        numbers: list[Any] = [self.tokens_per_s, self.staleness_mean, self.uptime_s, *self.sketch]
        numbers.append(self.heartbeat_period_s)
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in numbers):
            raise HeartbeatError("heartbeat carries a non-finite number")
        if not all(isinstance(m, str) for m in self.maddrs) or len(self.sketch) > 256:
            raise HeartbeatError("heartbeat has malformed addresses or sketch")
        self._check_dashboard_fields()

    def _check_dashboard_fields(self) -> None:
        """What the dashboard shows as text or numbers is checked here, not trusted there."""
        if not all(isinstance(v, str) for v in (self.org, self.version, self.device)):
            raise HeartbeatError("org, version and device must be strings")
        optional = (self.loss, self.val_loss, self.drift)
        if not all(v is None or _is_finite_number(v) for v in optional):
            raise HeartbeatError("loss, val_loss and drift must be finite numbers or null")
        merged, rejections = self.merged_by_author, self.rejections
        if not isinstance(merged, dict) or len(merged) > MAX_AUTHORS:
            raise HeartbeatError(f"merged_by_author must map at most {MAX_AUTHORS} authors")
        histogram = self.staleness_histogram
        if not isinstance(histogram, list) or len(histogram) > len(STALENESS_BUCKETS):
            raise HeartbeatError("staleness_histogram has too many buckets")
        if not isinstance(rejections, dict):
            raise HeartbeatError("rejections must map reasons to counts")
        keys = [*merged, *rejections]
        counts = [*merged.values(), *rejections.values(), *histogram]
        if not all(isinstance(k, str) for k in keys) or not all(_is_count(c) for c in counts):
            raise HeartbeatError("heartbeat counts must be non-negative integers")


def _is_finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
