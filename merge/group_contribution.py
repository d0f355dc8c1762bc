"""What one member contributes to its learner group's round, and how the reduction scales it.

The signed :class:`ContributionHeader` (and the :class:`RoundFields` every member of a round
signs alike; `_shared`: what they must agree on), the statement a reducer co-signs over its
shard, the run's :class:`ReductionConfig`, and the in-group robust clip (`clip_scales`,
`clipped_mean`): the pieces a :class:`~merge.group_applied.GroupUpdate` and
:class:`~merge.group_update.GroupReduction` are built from. Moved out of merge/group_update.py
unchanged (session 24); merge.group_update re-exports every public name. Pure: no network,
no clock.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import statistics
from dataclasses import dataclass, replace

import torch

from merge.identity import Identity, verify_signature

_CONTRIBUTION_TAG = b"diloco-group-contribution-v1\x00"
_SHARD_TAG = b"diloco-group-shard-v1\x00"
SIGNATURE_BYTES = 64


@dataclass(frozen=True, kw_only=True)
class ReductionConfig:
    """How a group reduction decides; part of the run's settings."""

    quorum_share: float = 0.5
    """Share of the group's members that must contribute by the deadline, else abandon."""
    max_retries: int = 1
    """Times the reduction restarts without a member lost while reducing, then abandons."""
    max_norm_to_median: float = 4.0
    """A contribution's norm is clipped to this times the median of the included members'
    signed norms (with 3 or more included; 0: off)."""

    def __post_init__(self) -> None:
        if not isinstance(self.quorum_share, int | float) or not 0 < self.quorum_share <= 1:
            raise ValueError(f"quorum_share must be in (0, 1], got {self.quorum_share!r}.")
        if type(self.max_retries) is not int or self.max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {self.max_retries!r}.")
        ratio = self.max_norm_to_median
        if not isinstance(ratio, int | float) or not (math.isfinite(ratio) and ratio >= 0):
            raise ValueError(f"max_norm_to_median must be a finite number >= 0, got {ratio!r}.")

    def quorum(self, num_members: int) -> int:
        """Contributions a group of `num_members` needs by the deadline (at least one)."""
        return max(1, math.ceil(self.quorum_share * num_members))


def tensor_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a flat fp32 tensor's little-endian bytes."""
    data = tensor.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False)
    return hashlib.sha256(data.tobytes()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class ContributionHeader:
    """What one member signs about its pseudo-gradient for one group round."""

    run_id: str
    author: str
    group_key: str
    epoch: int
    round: int
    learners: int
    """The epoch's learner count (non-empty groups) that sizes the group's update."""
    base_applied: int
    published_applied: int
    tokens: int
    norm: float
    digest: str
    signature: bytes = b""

    def signing_bytes(self) -> bytes:
        signed = {name: getattr(self, name) for name in _SIGNED_FIELDS}
        return _CONTRIBUTION_TAG + json.dumps(signed, sort_keys=True).encode()

    def wire_bytes(self) -> int:
        """Bytes the header takes on the wire: its signed fields and the signature."""
        return len(self.signing_bytes()) + SIGNATURE_BYTES

    def signed(self, identity: Identity) -> ContributionHeader:
        if identity.peer_id != self.author:
            raise ValueError("a contribution is signed by its author.")
        return replace(self, signature=identity.sign(self.signing_bytes()))

    @functools.cached_property
    def _verified(self) -> bool:
        return verify_signature(self.author, self.signing_bytes(), self.signature)

    def verified(self) -> bool:
        """Whether the author signed these fields (checked once per parsed header)."""
        return self._verified

    @classmethod
    def of(
        cls, pseudo_gradient: torch.Tensor, identity: Identity, round_: RoundFields, tokens: int
    ) -> ContributionHeader:
        """The signed header of ``identity``'s ``pseudo_gradient`` (its norm and digest)."""
        header = cls(
            **round_.__dict__,
            author=identity.peer_id,
            tokens=tokens,
            norm=float(torch.linalg.vector_norm(pseudo_gradient)),
            digest=tensor_digest(pseudo_gradient),
        )
        return header.signed(identity)


@dataclass(frozen=True, kw_only=True)
class RoundFields:
    """What a member of a group round signs: alike for every member but the applied counts
    (its own replica's, at its round's start and at its contribution)."""

    run_id: str
    group_key: str
    epoch: int
    round: int
    learners: int
    base_applied: int
    published_applied: int


_SIGNED_FIELDS = tuple(
    f.name for f in dataclasses.fields(ContributionHeader) if f.name != "signature"
)


def shard_statement(
    headers: tuple[ContributionHeader, ...], shard: int, shard_digest: str
) -> bytes:
    """What the reducer of ``shard`` co-signs: the round, who is included, its shard."""
    first = headers[0]
    fields = (first.run_id, first.group_key, first.epoch, first.round)
    return included_statement(fields, [h.author for h in headers], shard, shard_digest)


def included_statement(
    round_fields: tuple[str, str, int, int], included: list[str], shard: int, shard_digest: str
) -> bytes:
    """`shard_statement` from the round ((run id, group key, epoch, round)) and the included
    members alone: what a proof of a group's equivocation (merge.group_equivocation) holds."""
    run_id, group_key, epoch, round_ = round_fields
    signed = {
        "run_id": run_id,
        "group_key": group_key,
        "epoch": epoch,
        "round": round_,
        "included": included,
        "shard": shard,
        "shard_digest": shard_digest,
    }
    return _SHARD_TAG + json.dumps(signed, sort_keys=True).encode()


def clip_scales(norms: list[float], config: ReductionConfig) -> list[float]:
    """Each included contribution's scale: its signed norm clipped to `max_norm_to_median` x
    the median signed norm (with 3 or more included): from signed headers alone, so every
    reducer of any shard scales a member's part alike."""
    bound = config.max_norm_to_median * statistics.median(norms)
    clip = len(norms) >= 3 and bound > 0
    return [bound / norm if clip and norm > bound else 1.0 for norm in norms]


def clipped_mean(
    tensors: list[torch.Tensor], norms: list[float], config: ReductionConfig
) -> torch.Tensor:
    """The mean of `tensors` (whole parts, or one shard of each) scaled by `clip_scales`;
    rounded to bf16 when every one of them holds bf16 values (parts sent in bf16)."""
    total = torch.zeros_like(tensors[0])
    for tensor, scale in zip(tensors, clip_scales(norms, config), strict=True):
        total.add_(tensor, alpha=scale)
    mean = total.div_(len(tensors))
    if all(_holds_bf16(t) for t in tensors):
        return mean.to(torch.bfloat16).to(torch.float32)
    return mean


def _holds_bf16(tensor: torch.Tensor) -> bool:
    """Whether every value of `tensor` is a bfloat16 value (a part sent in bf16)."""
    return torch.equal(tensor.to(torch.bfloat16).to(torch.float32), tensor)


def _shared(h: ContributionHeader) -> tuple[object, ...]:
    """What every contribution of one round signs alike (each member signs its own replica's
    applied counts: the group's staleness is their median)."""
    return (h.run_id, h.group_key, h.epoch, h.round, h.learners)
