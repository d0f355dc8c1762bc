"""Signed heartbeats: what every node tells the swarm about itself, every few seconds.

A heartbeat is a strict typed model (a pydantic dataclass in strict mode): every field has a
type, a bounded length and, for numbers, a finite range, so a heartbeat that a peer crafted
(`sketch: null`, a list as `applied_digest`, a loss of 10**400, two val_loss of 1e308 whose
sum overflows) is rejected when it is parsed, before membership, the learner, `status` or
the dashboard read it. Construction validates too: a node cannot sign a heartbeat that its
peers would refuse.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable, Iterable
from typing import Annotated

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass

from dht.reachability import PathKind
from merge.identity import Identity, verify_signature

MAGIC = b"DHB1"
MAX_BODY_BYTES = 16 * 1024
SIGNATURE_BYTES = 64
STATES = ("syncing", "training", "idle")
MAX_AUTHORS = 128
"""Authors listed in `merged_by_author` (those with the most merged updates first)."""
STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32)
"""Lower edges of the staleness histogram's buckets: 0, 1, 2-3, 4-7, 8-15, 16-31, 32+."""
MAX_COUNT = 2**53
"""Counters above this are refused: they cannot be honest and do not survive JSON floats."""
MAX_LOSS = 1e6
"""Losses above this are refused (a byte-level model starts near ln 256 = 5.5)."""
MAX_SKETCH = 256
MAX_MADDRS = 16
MAX_REJECTION_REASONS = 64
MAX_REJECTED_PEERS = 8
MAX_REJECTED_REASONS = 8
MAX_GROUP_BITS = 16
OMITTED_WHEN_NONE = ("group_bits", "group_epoch", "codec", "codec_auto", "uplink_bytes_per_s")
"""Fields added after strict parsing shipped (extra="forbid"): left out of the signed body
while unset, so a node with groups off sends what older nodes accept, byte for byte. A run
with groups on has its own fingerprint, which older nodes do not join. The codec's fields
likewise: a heartbeat without them (an older node's) parses, and shows them as unknown."""
OMITTED_WHEN_ZERO = ("num_need_state",)
"""Counts added after strict parsing shipped, left out of the signed body while 0: a node with
nothing to report sends what older nodes accept, byte for byte, and a heartbeat without them
(an older node's) parses as 0."""
MAX_UPLINK = 1e12
"""Uplinks above this (bytes per second) are refused: a terabyte a second is no home link."""
REASONS = ("malformed", "bad_signature", "wrong_peer", "too_large", "not_allowed")

PeerId = Annotated[str, Field(min_length=1, max_length=128)]
Label = Annotated[str, Field(max_length=64)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, Field(ge=0, le=1e10, allow_inf_nan=False)]
Rate = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]
Loss = Annotated[float, Field(ge=0, le=MAX_LOSS, allow_inf_nan=False)]
SketchValue = Annotated[float, Field(ge=-1e12, le=1e12, allow_inf_nan=False)]
Digest = Annotated[str, Field(pattern=r"^([0-9a-f]{64})?$")]
Maddr = Annotated[str, Field(min_length=1, max_length=256)]
CodecName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,15}$")]
"""A codec's name (merge.codecs): lower-case letters, digits and _, at most 16; a name this
node does not know (a later version's codec) parses and is shown as sent."""


def staleness_bucket(staleness: int) -> int:
    """Index of the `STALENESS_BUCKETS` bucket that holds `staleness`."""
    return max(i for i, edge in enumerate(STALENESS_BUCKETS) if staleness >= edge)


class HeartbeatError(ValueError):
    """A heartbeat that is malformed or not signed by the peer it claims to come from."""

    def __init__(self, reason: str, detail: str) -> None:
        assert reason in REASONS, reason
        super().__init__(detail)
        self.reason = reason
        """One of REASONS: what rejections are counted by (as `heartbeat_<reason>`)."""


_STRICT = ConfigDict(strict=True, extra="forbid")


@dataclass(frozen=True, kw_only=True, config=_STRICT)
class Heartbeat:
    peer_id: PeerId
    org: Label = ""
    version: Label = ""
    device: Label = ""
    memory_gb: Annotated[float, Field(ge=0, le=1e7, allow_inf_nan=False)] = 0.0
    state: Annotated[str, Field(pattern=f"^({'|'.join(STATES)})$")] = "training"
    round: Count = 0
    tokens_per_s: Rate = 0.0
    steps_per_s: Rate = 0.0
    """Inner steps per second of inner-step time (a moving average; 0: not measured yet).
    Peers running --dynamic-h size their rounds by it (node.round_size)."""
    loss: Loss | None = None
    val_loss: Loss | None = None
    num_applied: Count = 0
    applied_digest: Digest = ""
    latest_seq: Count = 0
    updates_published: Count = 0
    updates_merged: Count = 0
    staleness_mean: Annotated[float, Field(ge=0, le=MAX_COUNT, allow_inf_nan=False)] = 0.0
    drift: Annotated[float, Field(ge=0, le=1e6, allow_inf_nan=False)] | None = None
    sketch: Annotated[list[SketchValue], Field(max_length=MAX_SKETCH)] = dataclasses.field(
        default_factory=list
    )
    uptime_s: Seconds = 0.0
    maddrs: Annotated[list[Maddr], Field(max_length=MAX_MADDRS)] = dataclasses.field(
        default_factory=list
    )
    serves_state: bool = True
    rejections: Annotated[dict[Label, Count], Field(max_length=MAX_REJECTION_REASONS)] = (
        dataclasses.field(default_factory=dict)
    )
    """Rejections this node counted, by reason (updates, heartbeats, state)."""
    sent_at: Seconds = 0.0
    merged_by_author: Annotated[dict[PeerId, Count], Field(max_length=MAX_AUTHORS)] = (
        dataclasses.field(default_factory=dict)
    )
    """Updates of each author in this replica's applied set (at most MAX_AUTHORS authors)."""
    staleness_histogram: Annotated[list[Count], Field(max_length=len(STALENESS_BUCKETS))] = (
        dataclasses.field(default_factory=list)
    )
    """Updates this node merged since it started, counted per STALENESS_BUCKETS bucket."""
    heartbeat_period_s: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)] = 0.0
    """The sender's heartbeat period: observers call it dead after three silent periods."""
    bytes_sent: Count = 0
    """Bytes the sender sent to peers over streams since it started (updates, state, ...)."""
    bytes_received: Count = 0
    """Bytes the sender received from peers over streams since it started."""
    rejected_peers: Annotated[
        dict[PeerId, Annotated[dict[Label, Count], Field(max_length=MAX_REJECTED_REASONS)]],
        Field(max_length=MAX_REJECTED_PEERS),
    ] = dataclasses.field(default_factory=dict)
    """The peers whose input this node rejected most: peer -> reason -> count."""
    num_lost: Count = 0
    """Updates this node knows were published but no live peer could give it."""
    num_need_state: Count = 0
    """Updates this node wants that no live peer offers but a live state-serving peer named
    applied: they wait for a state download (dht.catchup_state), not counted lost. Sent only
    when not 0 (OMITTED_WHEN_ZERO)."""
    num_realigned: Count = 0
    """Times this node replaced its parameters by a peer's because they had drifted apart at
    one applied set (dht.realign): peers forget what they saw of its earlier parameters."""
    paths: Annotated[dict[PathKind, Count], Field(max_length=3)] = dataclasses.field(
        default_factory=dict
    )
    """Connected peers per path (direct, holepunched, relayed); empty from a sender that does
    not measure them (a node of an earlier version, or one outside a swarm)."""
    group_bits: Annotated[int, Field(ge=0, le=MAX_GROUP_BITS)] | None = None
    """Learner groups (docs/scale.md): the bits of the grouping this node is in this epoch;
    None (never sent) while groups are off."""
    group_epoch: Count | None = None
    """The epoch `group_bits` was decided for; None (never sent) while groups are off."""
    codec: CodecName | None = None
    """The codec the sender sends its updates with (its last round's, or `--codec auto`'s
    latest pick); None (never sent) from a node of an earlier version: shown as unknown."""
    codec_auto: bool | None = None
    """Whether `--codec auto` picked `codec` from the measured uplink (else `--codec` named
    it); None (never sent) from a node of an earlier version."""
    uplink_bytes_per_s: Annotated[float, Field(ge=0, le=MAX_UPLINK, allow_inf_nan=False)] | None = (
        None
    )
    """The sender's uplink as measured from its own sends (merge.codec_uplink), bytes per
    second; None (never sent) until measured, or from a node of an earlier version."""

    def sign(self, identity: Identity) -> bytes:
        if identity.peer_id != self.peer_id:
            raise ValueError("a heartbeat must be signed by the peer it describes")
        fields = dataclasses.asdict(self)
        for name in OMITTED_WHEN_NONE:  # an older node's strict parser refuses them
            if fields[name] is None:
                del fields[name]
        for name in OMITTED_WHEN_ZERO:
            if fields[name] == 0:
                del fields[name]
        return sign_fields(fields, identity)

    @classmethod
    def verify(cls, blob: object, expected_peer_id: str) -> Heartbeat:
        """Parse an untrusted blob; HeartbeatError unless `expected_peer_id` signed it."""
        raw = _signed_body(blob, expected_peer_id)
        try:
            heartbeat = _ADAPTER.validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "heartbeat"
            raise HeartbeatError("malformed", f"{where}: {first['msg']}") from None
        if heartbeat.peer_id != expected_peer_id:
            raise HeartbeatError("wrong_peer", "heartbeat names another peer")
        return heartbeat


_ADAPTER: TypeAdapter[Heartbeat] = TypeAdapter(Heartbeat)


def sign_fields(fields: dict[str, object], identity: Identity) -> bytes:
    """The wire form of a heartbeat body, whatever it holds (tests sign mistyped ones)."""
    raw = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + struct.pack(">I", len(raw)) + raw + identity.sign(raw)


def _signed_body(blob: object, expected_peer_id: str) -> bytes:
    """The JSON body of a heartbeat blob, once its signature by `expected_peer_id` checks."""
    if not isinstance(blob, bytes) or len(blob) < 8 or blob[:4] != MAGIC:
        raise HeartbeatError("malformed", "not a heartbeat")
    (length,) = struct.unpack(">I", blob[4:8])
    if length > MAX_BODY_BYTES:
        raise HeartbeatError("too_large", f"heartbeat body of {length} bytes")
    if len(blob) != 8 + length + SIGNATURE_BYTES:
        raise HeartbeatError("malformed", "heartbeat has a wrong length")
    raw, signature = blob[8 : 8 + length], blob[8 + length :]
    if not verify_signature(expected_peer_id, raw, signature):
        raise HeartbeatError("bad_signature", "heartbeat signature does not match its peer id")
    return raw


def count_learners(alive: Iterable[Heartbeat], has_contributed: Callable[[str], bool]) -> int:
    """Live peers that count as learners when an update is sized (its `learners`): not idle,
    and with at least one update in this replica. A fresh key's heartbeat alone costs nothing
    to forge; counting a thousand of them would shrink every honest update's share of a round
    (an outer-step dilution by Sybils). A newcomer counts from its first applied update on."""
    return sum(h.state != "idle" and has_contributed(h.peer_id) for h in alive)
