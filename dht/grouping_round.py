"""One member's side of a learner group's round, and the messages members exchange for it.

Step 3 of docs/scale.md's wiring plan, the pure part (dht/group_exchange.py does the network):

- `group-part` and `group-update`, the messages that carry tensors: dht.grouping_wire;
  `group-done`, the notice that a member completed a round: dht.grouping_done.
- `group-cosign`: a member's co-signature over its shard of the aggregate, for one included
  set (`merge.group_update.shard_statement`).
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

import json
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from dht.grouping_patience import round_deadlines
from dht.grouping_wire import (
    MAX_COUNT,
    MAX_MEMBERS,
    MAX_TEXT,
    GroupMessageError,
    RoundId,
    names_a_round,
)
from merge.group_update import (
    SIGNATURE_BYTES,
    Abandoned,
    ContributionHeader,
    GroupReduction,
    GroupUpdate,
    Phase,
    ReductionConfig,
)
from merge.identity import Identity

COSIGN_MAGIC = b"DGC2"
"""DGC2 since session 27: the shard a member co-signs is cut on the chunk grid and its digest
is a chunk root (merge.group_chunks); a session 26 peer's DGC1 is refused as "old_version"."""
OLD_COSIGN_MAGIC = b"DGC1"


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


def cosign_max_bytes() -> int:
    return len(COSIGN_MAGIC) + 512 + MAX_MEMBERS * (MAX_TEXT + 4)


def decode_cosign(blob: object) -> Cosign:
    """An untrusted `group-cosign` blob's fields (its signature is checked by the round
    it is for, against the statement of that round's included set)."""
    if isinstance(blob, bytes) and blob[:4] == OLD_COSIGN_MAGIC:
        raise GroupMessageError("old_version", "a session 26 co-signature (DGC1)")
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
