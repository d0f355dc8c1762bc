"""One member's side of a learner group's round, and the messages members exchange for it.

Step 3 of docs/scale.md's wiring plan, the pure part (dht/group_exchange.py does the network):

- `group-part`: a member's signed `ContributionHeader` and its pseudo-gradient in the swarm's
  codec (`DGP2`: what the member signed is the decoded tensor, the codec's rounding kept in
  its error feedback, node.group_publishing; `DGP1`, fp32, is still read), sent to every
  other member of its group. What arrives is untrusted: `decode_part` refuses anything
  malformed, over the size the replica allows, or not signed by its author (a
  `GroupMessageError` with the reason the caller counts), never raising anything else.
- `group-cosign`: a member's co-signature over its shard of the aggregate, for one included
  set (`merge.group_update.shard_statement`).
- `group-done`: a small notice that a member completed a round (its id and included set),
  sent instead of the whole update: a member still waiting fetches the update from the
  notifier only when it needs it (`done_action`), a peer outside the group fetches it once
  from one holder (the gossip's catch-up), not once per pushing member.
- `GroupRound` drives `merge.group_update.GroupReduction` for this member from events with
  their time: parts in until the deadline (a member not in by then is left out, never waited
  for; the round closes early once every member is in), then this member's co-signature out,
  the others' in; a member lost while co-signing (its stream failed, or it is no longer
  alive) makes the reduction retry once without it; co-signatures not all in by the co-sign
  deadline abandon it. The outcome is a complete `GroupUpdate` or `Abandoned`, never half.

Every member reduces the whole aggregate from the whole contributions (all-to-all inside the
group: (g - 1) x U received per member and round, bounded by the group, not the swarm) and
co-signs the shard it is named for; the reduce-scatter that would cut that to ~U is not
written (docs/scale.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from dht.grouping_patience import round_deadlines
from merge.codec_base import CodecError
from merge.codecs import get_codec
from merge.group_update import (
    SIGNATURE_BYTES,
    Abandoned,
    ContributionHeader,
    GroupReduction,
    GroupUpdate,
    Phase,
    ReductionConfig,
    tensor_digest,
)
from merge.identity import Identity

PART_MAGIC = b"DGP1"
CODED_PART_MAGIC = b"DGP2"
DONE_MAGIC = b"DGD1"
COSIGN_MAGIC = b"DGC1"
UPDATE_MAGIC = b"DGU1"
BF16_UPDATE_MAGIC = b"DGU2"
"""A group update whose aggregate holds bf16 values (parts in bf16), sent in bf16."""
MAX_HEADER_BYTES = 4096
"""A contribution header's JSON (~550 B honest) may take at most this."""
MAX_MEMBERS = 1024
"""Members one co-signature's included set may name (a group of 1000 swarms is ~32)."""
MAX_COUNT = 2**53
MAX_TEXT = 128
_HEADER_FIELDS = {
    "run_id": str,
    "author": str,
    "group_key": str,
    "epoch": int,
    "round": int,
    "learners": int,
    "base_applied": int,
    "published_applied": int,
    "tokens": int,
    "norm": float,
    "digest": str,
    "signature": str,
}
RoundId = tuple[str, int, int]
"""(group key, epoch, round): one group round, the id its group update is applied under."""


class GroupMessageError(ValueError):
    """A group message refused before anything of it is kept; `reason` is what is counted."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def part_max_bytes(numel: int) -> int:
    """The largest `group-part` blob a receiver reads for a replica of `numel` parameters."""
    return len(PART_MAGIC) + 4 + MAX_HEADER_BYTES + 1 + MAX_CODEC_NAME + 4 * numel


MAX_CODEC_NAME = 16


def _header_fields(header: ContributionHeader) -> dict[str, object]:
    fields = {name: getattr(header, name) for name in _HEADER_FIELDS if name != "signature"}
    fields["signature"] = header.signature.hex()
    return fields


def encode_part(
    header: ContributionHeader,
    tensor: torch.Tensor,
    codec: str = "fp32",
    payload: bytes | None = None,
) -> bytes:
    """A member's part: its signed header, then `tensor` in `codec` (`payload`: its encoding,
    when at hand, `coded`'s). The header must sign the tensor the receivers decode: a lossy
    codec's rounding is the sender's to keep (`coded`)."""
    raw = json.dumps(_header_fields(header), sort_keys=True, separators=(",", ":")).encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"a contribution header of {len(raw)} bytes is over {MAX_HEADER_BYTES}.")
    head = struct.pack(">I", len(raw)) + raw
    if codec == "fp32":
        flat = tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
        return PART_MAGIC + head + flat.tobytes()
    name = codec.encode()
    if not 0 < len(name) <= MAX_CODEC_NAME:
        raise ValueError(f"codec name {codec!r} is too long.")
    if payload is None:
        payload = get_codec(codec).encode(tensor.detach().to(torch.float32).contiguous())
    return CODED_PART_MAGIC + head + bytes([len(name)]) + name + payload


def coded(tensor: torch.Tensor, codec: str) -> tuple[torch.Tensor, bytes]:
    """What receivers will decode of `tensor` sent in `codec`, and the payload: the member
    signs the former and keeps `tensor` minus it in its error feedback. CodecError for a
    tensor the codec cannot encode (not finite)."""
    c = get_codec(codec)
    payload = c.encode(tensor.detach().to(torch.float32).contiguous())
    return c.decode(payload, tensor.numel()), payload


def decode_part(blob: object, numel: int) -> tuple[ContributionHeader, torch.Tensor]:
    """The header and pseudo-gradient of an untrusted `group-part` blob (fp32 or coded), its
    author's signature and the decoded tensor's digest checked; GroupMessageError otherwise."""
    if (
        not isinstance(blob, bytes)
        or len(blob) < 8
        or blob[:4] not in (PART_MAGIC, CODED_PART_MAGIC)
    ):
        raise GroupMessageError("malformed", "not a group part")
    (length,) = struct.unpack(">I", blob[4:8])
    if length > MAX_HEADER_BYTES or len(blob) < 8 + length:
        raise GroupMessageError("malformed", f"a group part's header of {length} bytes")
    try:
        fields = json.loads(blob[8 : 8 + length])
    except (ValueError, RecursionError):
        raise GroupMessageError("malformed", "a group part's header is not JSON") from None
    header = _parse_header(fields)
    body = blob[8 + length :]
    tensor = _fp32(body, numel) if blob[:4] == PART_MAGIC else _coded(body, numel)
    if tensor_digest(tensor) != header.digest or not header.verified():
        raise GroupMessageError("bad_signature", "a group part its author did not sign")
    return header, tensor


def _coded(body: bytes, numel: int) -> torch.Tensor:
    """A coded part's tensor: a codec name the swarm knows, its payload of the exact size."""
    if not body or not 0 < body[0] <= MAX_CODEC_NAME or len(body) < 1 + body[0]:
        raise GroupMessageError("malformed", "a coded part without a codec name")
    try:
        codec = get_codec(body[1 : 1 + body[0]].decode("ascii"))
        tensor = codec.decode(body[1 + body[0] :], numel)
    except UnicodeDecodeError:
        raise GroupMessageError("malformed", "a codec name that is not ASCII") from None
    except CodecError as exc:
        raise GroupMessageError("wrong_size", f"a coded part that does not decode: {exc}") from None
    if tensor.shape != (numel,) or not bool(torch.isfinite(tensor).all()):
        raise GroupMessageError("not_finite", "a group message holds NaN or infinity")
    return tensor


def _fp32(body: bytes, numel: int) -> torch.Tensor:
    if len(body) != 4 * numel:
        raise GroupMessageError("wrong_size", f"{len(body)} tensor bytes, expected {4 * numel}")
    tensor = torch.from_numpy(np.frombuffer(body, dtype="<f4").astype(np.float32))
    if not bool(torch.isfinite(tensor).all()):
        raise GroupMessageError("not_finite", "a group message holds NaN or infinity")
    return tensor


def _in_range(value: Any) -> bool:
    if isinstance(value, str):
        return 0 < len(value) <= MAX_TEXT
    if isinstance(value, int):
        return 0 <= value <= MAX_COUNT
    return math.isfinite(value) and 0 <= value <= 1e30


def _parse_header(fields: object) -> ContributionHeader:
    if not isinstance(fields, dict) or set(fields) != set(_HEADER_FIELDS):
        raise GroupMessageError("malformed", "a group part's header has the wrong fields")
    for name, kind in _HEADER_FIELDS.items():
        value: Any = fields[name]
        if kind is float and type(value) is int:
            value = fields[name] = float(value)
        if type(value) is not kind:
            raise GroupMessageError("malformed", f"{name} is not a {kind.__name__}")
        if not _in_range(value):
            raise GroupMessageError("malformed", f"{name} out of range")
    try:
        signature = bytes.fromhex(fields.pop("signature"))
    except ValueError:
        raise GroupMessageError("malformed", "signature is not hex") from None
    if len(signature) != SIGNATURE_BYTES:
        raise GroupMessageError("malformed", "signature of a wrong length")
    return ContributionHeader(**fields, signature=signature)


def encode_update(update: GroupUpdate) -> bytes:
    """A complete group update on the wire: its included members' signed headers, shard
    digests and co-signatures (JSON), then the aggregate (fp32)."""
    raw = json.dumps(update_meta(update), separators=(",", ":")).encode()
    head = struct.pack(">I", len(raw)) + raw
    aggregate = update.aggregate.detach().to(torch.float32).contiguous()
    narrow = aggregate.to(torch.bfloat16)
    if torch.equal(narrow.to(torch.float32), aggregate):  # bf16 values: half the bytes, exact
        return BF16_UPDATE_MAGIC + head + get_codec("bf16").encode(aggregate)
    return UPDATE_MAGIC + head + aggregate.numpy().astype("<f4").tobytes()


def update_max_bytes(numel: int) -> int:
    return len(UPDATE_MAGIC) + 4 + MAX_MEMBERS * (MAX_HEADER_BYTES + 400) + 4 * numel


def decode_update(blob: object, numel: int) -> GroupUpdate:
    """An untrusted group update's fields; its signatures, co-signatures and shards are
    checked by whoever takes it (GroupUpdate.problem), as every replica does."""
    if (
        not isinstance(blob, bytes)
        or len(blob) < 8
        or blob[:4]
        not in (
            UPDATE_MAGIC,
            BF16_UPDATE_MAGIC,
        )
    ):
        raise GroupMessageError("malformed", "not a group update")
    (length,) = struct.unpack(">I", blob[4:8])
    if len(blob) < 8 + length:
        raise GroupMessageError("malformed", "a group update cut short")
    update = update_of_meta(blob[8 : 8 + length], torch.empty(0))  # the fields first
    body = blob[8 + length :]
    aggregate = _fp32(body, numel) if blob[:4] == UPDATE_MAGIC else _bf16(body, numel)
    return dataclasses.replace(update, aggregate=aggregate)


def update_meta(update: GroupUpdate) -> dict[str, object]:
    """A group update's fields but its aggregate (JSON-ready): headers, digests, co-signatures
    and, with reduce-scatter, the member list its split is fixed by."""
    meta: dict[str, object] = {
        "headers": [_header_fields(h) for h in update.contributions],
        "digests": list(update.shard_digests),
        "cosignatures": [c.hex() for c in update.cosignatures],
    }
    if update.members:  # reduce-scatter: the member list its split is fixed by
        meta["members"] = list(update.members)
    return meta


def update_of_meta(raw: bytes, aggregate: torch.Tensor) -> GroupUpdate:
    """An untrusted group update from its JSON fields (`update_meta`) and an aggregate (empty
    when only some shards are at hand: dht.shard_fetch_wire); GroupMessageError when they do
    not parse. Its signatures are checked by whoever takes it."""
    try:
        meta = json.loads(raw)
        heads, digests, cosigns = meta["headers"], meta["digests"], meta["cosignatures"]
        if not all(isinstance(x, list) for x in (heads, digests, cosigns)):
            raise TypeError("lists expected")
        if not 0 < len(heads) <= MAX_MEMBERS:
            raise ValueError("members out of range")
        headers = tuple(_parse_header(h) for h in heads)
        shard_digests = tuple(d if isinstance(d, str) else "" for d in digests)
        cosignatures = tuple(bytes.fromhex(c) for c in cosigns)
        members = meta.get("members", [])
        if not isinstance(members, list) or not names_a_round("x", members or ["x"]):
            raise ValueError("members out of range")
    except GroupMessageError:
        raise
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise GroupMessageError("malformed", "a group update that does not parse") from None
    return GroupUpdate(headers, shard_digests, cosignatures, aggregate, tuple(members))


def _bf16(body: bytes, numel: int) -> torch.Tensor:
    try:
        tensor = get_codec("bf16").decode(body, numel)
    except CodecError:
        raise GroupMessageError("wrong_size", f"{len(body)} bytes, expected {2 * numel}") from None
    if not bool(torch.isfinite(tensor).all()):
        raise GroupMessageError("not_finite", "a group message holds NaN or infinity")
    return tensor


@dataclass(frozen=True)
class Cosign:
    """A member's co-signature over its shard, for one included set of one group round."""

    group_key: str
    epoch: int
    round: int
    included: tuple[str, ...]
    signature: bytes

    @property
    def round_id(self) -> RoundId:
        return (self.group_key, self.epoch, self.round)

    def to_bytes(self) -> bytes:
        fields = {
            "group_key": self.group_key,
            "epoch": self.epoch,
            "round": self.round,
            "included": list(self.included),
            "signature": self.signature.hex(),
        }
        return COSIGN_MAGIC + json.dumps(fields, separators=(",", ":")).encode()


def names_a_round(group_key: object, included: object) -> bool:
    """Whether an untrusted message's group key and included member list are in range (a
    co-signature and a group-done notice name their round alike)."""
    return (
        isinstance(group_key, str)
        and 0 < len(group_key) <= MAX_TEXT
        and isinstance(included, list)
        and 0 < len(included) <= MAX_MEMBERS
        and all(isinstance(m, str) and 0 < len(m) <= MAX_TEXT for m in included)
    )


def cosign_max_bytes() -> int:
    return len(COSIGN_MAGIC) + 512 + MAX_MEMBERS * (MAX_TEXT + 4)


def decode_cosign(blob: object) -> Cosign:
    """An untrusted `group-cosign` blob's fields (its signature is checked by the round
    it is for, against the statement of that round's included set)."""
    if not isinstance(blob, bytes) or blob[:4] != COSIGN_MAGIC:
        raise GroupMessageError("malformed", "not a co-signature")
    try:
        fields = json.loads(blob[4:])
        included = fields["included"]
        cosign = Cosign(
            fields["group_key"],
            fields["epoch"],
            fields["round"],
            tuple(included),
            bytes.fromhex(fields["signature"]),
        )
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise GroupMessageError("malformed", "a co-signature that does not parse") from None
    ok = (
        names_a_round(cosign.group_key, included)
        and all(type(v) is int and 0 <= v <= MAX_COUNT for v in (cosign.epoch, cosign.round))
        and len(cosign.signature) == SIGNATURE_BYTES
    )
    if not ok:
        raise GroupMessageError("malformed", "a co-signature with fields out of range")
    return cosign


@dataclass(frozen=True)
class Done:
    """A member's notice that it completed a group round: the round and its included set.
    Not signed: it is a hint to fetch, and what is fetched is checked as every update is."""

    group_key: str
    epoch: int
    round: int
    included: tuple[str, ...]

    @property
    def round_id(self) -> RoundId:
        return (self.group_key, self.epoch, self.round)

    @property
    def seq(self) -> int:
        """The seq replicas apply the round's update under (its group key as author)."""
        return self.round + 1

    def to_bytes(self) -> bytes:
        fields = {
            "group_key": self.group_key,
            "epoch": self.epoch,
            "round": self.round,
            "included": list(self.included),
        }
        return DONE_MAGIC + json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def of(cls, update: GroupUpdate) -> Done:
        head = update.head
        return cls(
            head.group_key, head.epoch, head.round, tuple(h.author for h in update.contributions)
        )


def done_max_bytes() -> int:
    return len(DONE_MAGIC) + 256 + MAX_MEMBERS * (MAX_TEXT + 4)


def decode_done(blob: object) -> Done:
    """An untrusted `group-done` blob's fields; GroupMessageError for anything else."""
    if not isinstance(blob, bytes) or blob[:4] != DONE_MAGIC:
        raise GroupMessageError("malformed", "not a group-done notice")
    try:
        fields = json.loads(blob[4:])
        included = fields["included"]
        done = Done(fields["group_key"], fields["epoch"], fields["round"], tuple(included))
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        raise GroupMessageError("malformed", "a group-done notice that does not parse") from None
    ok = names_a_round(done.group_key, included) and all(
        type(v) is int and 0 <= v < MAX_COUNT for v in (done.epoch, done.round)
    )
    if not ok:
        raise GroupMessageError("malformed", "a group-done notice with fields out of range")
    return done


DONE_GRACE_S = 2.0
"""How long a member still reducing the included set a notice names waits for its own
completion (its co-signatures in flight) before it fetches the update instead."""


class _Included(Protocol):
    @property
    def included(self) -> tuple[str, ...]: ...


class RoundView(Protocol):
    """What `done_action` reads of a running round (GroupRound, or dht.grouping_shards'
    ShardedRound)."""

    @property
    def done(self) -> bool: ...
    @property
    def outcome(self) -> GroupUpdate | Abandoned | None: ...
    @property
    def phase(self) -> Phase: ...
    @property
    def cosign_deadline(self) -> float: ...
    @property
    def reduction(self) -> _Included: ...


def done_action(
    member: RoundView | None,
    done: Done,
    settled: bool | None,
    now: float,
    *,
    waited: bool = False,
) -> float | str:
    """What this node does with a `group-done` notice for a round.

    `member`: this node's round of that id if it is running; `settled`: if it ran and ended
    here, whether it ended with the complete update (True) or without it (False), else None.
    Returns "ignore" (this node holds the update), "adopt" (fetch it from the notifier and
    adopt it: the round is running and cannot complete by itself, its included set differs
    or its co-signatures are late), "offer" (the gossip fetches it once from a holder, as any
    replica missing it: this node is outside the round, left out, gave up, or has not opened
    it), or a time (monotonic) to look again: the round reduces the same included set, and the
    co-signatures the notifier completed with were sent here too (`waited`: that time has
    passed, and the round is still running: "adopt")."""
    if member is not None:
        if member.done:
            return "ignore" if isinstance(member.outcome, GroupUpdate) else "offer"
        same = member.phase is Phase.REDUCING and member.reduction.included == done.included
        if same and not waited:
            return now + min(DONE_GRACE_S, max(member.cosign_deadline - now, 0.0))
        return "adopt"
    if settled:
        return "ignore"
    return "offer"


class GroupRound:
    """This member's side of one group round; pure: events in with their time, the
    co-signatures to send out. `outcome` is set once: a GroupUpdate or Abandoned."""

    def __init__(
        self,
        identity: Identity,
        header: ContributionHeader,
        tensor: torch.Tensor,
        members: Iterable[str],
        *,
        opened_at: float,
        wait_s: float,
        cosign_s: float,
        config: ReductionConfig | None = None,
        grace_s: float = 0.0,
    ) -> None:
        """`grace_s`: how long past its `wait_s` join window the round keeps collecting
        (dht.grouping_patience.grace_s); the co-sign deadline stays `cosign_s` past the join
        window (at least the collection's end), so a round ends within the same bound."""
        self.me = identity.peer_id
        self._identity = identity
        self.members = frozenset(members)
        if self.me not in self.members or header.author != self.me:
            raise ValueError("a group round is opened by a member with its own contribution.")
        self.reduction = GroupReduction(
            group_key=header.group_key,
            epoch=header.epoch,
            round=header.round,
            members=self.members,
            config=config,
        )
        self.deadline, self.cosign_deadline = round_deadlines(opened_at, wait_s, cosign_s, grace_s)
        self._held: dict[str, Cosign] = {}
        """Signer -> its latest co-signature (one per member: bounded by the group)."""
        if not self.reduction.contribute(header, tensor):
            raise ValueError(f"own contribution refused: {self.reduction.rejected}")

    @property
    def round_id(self) -> RoundId:
        r = self.reduction
        return (r.group_key, r.epoch, r.round)

    @property
    def phase(self) -> Phase:
        return self.reduction.phase

    @property
    def outcome(self) -> GroupUpdate | Abandoned | None:
        return self.reduction.outcome

    @property
    def done(self) -> bool:
        return self.reduction.outcome is not None

    def others(self) -> list[str]:
        """The members this member's part goes to."""
        return sorted(self.members - {self.me})

    def recipients(self) -> list[str]:
        """The included members this member's co-signature goes to."""
        return [m for m in self.reduction.included if m != self.me]

    def missing_cosigners(self) -> list[str]:
        held = self.reduction.cosigned
        return [m for m in self.reduction.included if m not in held]

    def on_part(self, header: ContributionHeader, tensor: torch.Tensor) -> bool:
        """A member's contribution (refusals counted in `reduction.rejected`)."""
        return self.reduction.contribute(header, tensor)

    def on_cosign(self, signer: str, cosign: Cosign) -> bool:
        """A member's co-signature; kept until this member reduces the same included set.
        False (counted) for one not from a member or not for this round."""
        if signer not in self.members or cosign.round_id != self.round_id:
            self._count("cosign_not_for_this_round")
            return False
        self._held[signer] = cosign
        self._apply_held()
        return True

    def tick(self, now: float) -> list[Cosign]:
        """The deadline (or every member in): close and co-sign; past the co-sign deadline
        with signatures missing: abandon. Returns this member's co-signature to send."""
        out: list[Cosign] = []
        r = self.reduction
        if r.phase is Phase.COLLECTING and (now >= self.deadline or r.contributors == self.members):
            r.close()
            out = self._sign()
        if r.phase is Phase.REDUCING and now >= self.cosign_deadline:
            r.expire()
        return out

    def adopt(self, update: GroupUpdate) -> bool:
        """Another member's complete update of this round (see GroupReduction.adopt)."""
        return self.reduction.adopt(update)

    def on_lost(self, member: str) -> list[Cosign]:
        """`member` died while co-signing: the reduction retries without it (once), and this
        member co-signs the new included set; or it abandons. A member whose co-signature of
        the current attempt is in has done its part and is not lost: retrying without it
        would let two included sets complete."""
        if member not in self.missing_cosigners():
            return []
        before = self.reduction.included
        self.reduction.lose(member)
        if self.reduction.phase is Phase.REDUCING and self.reduction.included != before:
            return self._sign()
        return []

    def _sign(self) -> list[Cosign]:
        r = self.reduction
        if r.phase is not Phase.REDUCING:
            return []
        signature = self._identity.sign(r.statement(self.me))
        r.cosign(self.me, signature)
        cosign = Cosign(r.group_key, r.epoch, r.round, r.included, signature)
        self._apply_held()
        return [cosign]

    def _apply_held(self) -> None:
        r = self.reduction
        for signer, cosign in list(self._held.items()):
            if r.phase is not Phase.REDUCING:
                return
            if signer != self.me and cosign.included == r.included:
                r.cosign(signer, cosign.signature)

    def _count(self, reason: str) -> None:
        self.reduction.rejected[reason] = self.reduction.rejected.get(reason, 0) + 1
