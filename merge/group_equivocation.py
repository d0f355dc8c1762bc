"""Equivocation by a learner group: two fully co-signed variants of one group round, the proof
of it, and what every replica keeps to build one (docs/scale.md, wiring plan step 5).

A group update is applied under the id (group key, round + 1). Two variants of one id, each
co-signed by every reducer of every shard (`GroupUpdate.problem` holds for both), split the
replicas that applied different ones for good: each applies the id once. The evidence that
settles it is what made each variant applicable, less what a replica needs only to step with
it: per variant the epoch, the included members, the member list the split is fixed by, the
shard digests and the reducers' co-signatures. From these any replica rebuilds each statement
(`included_statement`, `sharded_statement`) and checks each co-signature by its reducer, a
member of the group (`GroupRun.members_of`, dht.grouping.member_check) in this run (the
run id every statement signs). Contribution headers and aggregates stay out: they size and
step an update, they do not make it a variant.

Less would not do. A member's two co-signatures over different statements prove that member
signed twice, but an honest member does so when its round retries without a lost member
(dht.grouping_round), and one member alone could then void any round of its group; two
disjoint included sets share no member at all. Two complete variants are exactly what leaves
replicas apart, and what a replica that holds both finds alike (`GroupProof.of`: canonical).

What every replica then does is merge.equivocation's rule (withdraw / record / none), the
proof kept and passed on with the solo ones (`decode_proof` tells the two apart), unless
one variant includes more members (`prevailing`, docs/scale.md Session 21): then nothing is
voided, the lesser variant is withdrawn where it was applied and refused everywhere after,
so a member completing a variant of its group's round alone silences nothing.
Pure: no network, no replica.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from merge.equivocation import (
    MAX_FIRST_SEEN,
    MAX_PROOF_BYTES,
    Proof,
    ProofError,
    UpdateId,
    VariantKey,
    proof_bytes,
)
from merge.group_plan import ShardPlan, sharded_statement
from merge.group_update import SIGNATURE_BYTES, GroupUpdate, included_statement
from merge.identity import verify_signature

GROUP_PROOF_MAGIC = b"DLG1"
MAX_PROOF_MEMBERS = 1024
"""Members a variant may list (dht.grouping_wire.MAX_MEMBERS: no group update holds more)."""
MAX_NAME_CHARS = 128
"""A peer id's, a run id's and a group key's length (dht.grouping_wire.MAX_TEXT)."""
MAX_COUNT = 2**53
_PER_MEMBER = 2 * (MAX_NAME_CHARS + 3) + (64 + 3) + (2 * SIGNATURE_BYTES + 3)
MAX_GROUP_PROOF_BYTES = len(GROUP_PROOF_MAGIC) + 1024 + 2 * (512 + MAX_PROOF_MEMBERS * _PER_MEMBER)
"""A group proof's bound (~0.94 MiB at 1,024 members; a few KiB for a group of 8)."""
MAX_EVIDENCE_BYTES = max(MAX_GROUP_PROOF_BYTES, MAX_PROOF_BYTES)
"""What a pushed proof of either kind may take (dht.gossip_evidence)."""
MAX_VARIANT_BYTES_HELD = 64 * 2**20
"""What `AppliedVariants` holds of applied variants' evidence, at most."""
_HEX64 = re.compile(r"[0-9a-f]{64}")
_VARIANT_KEYS = {"epoch", "included", "members", "shard_digests", "cosignatures"}
_PROOF_KEYS = {"run_id", "group_key", "round", "variants"}

MemberCheck = Callable[[str], Callable[[str], bool]]
"""A group key -> whether a peer id belongs to that group (dht.grouping.member_check)."""


@dataclass(frozen=True)
class GroupRun:
    """What a group proof is checked against: the run's id and who belongs to a group key."""

    run_id: str
    members_of: MemberCheck


@dataclass(frozen=True)
class GroupVariant:
    """One variant of a group round as its reducers co-signed it (no headers, no tensor)."""

    epoch: int
    included: tuple[str, ...]
    members: tuple[str, ...]
    """The member list the split is fixed by (reduce-scatter); empty: one shard per included
    member (merge.group_update.GroupUpdate.members)."""
    shard_digests: tuple[str, ...]
    cosignatures: tuple[bytes, ...]

    @classmethod
    def of(cls, update: GroupUpdate) -> GroupVariant:
        return cls(
            update.head.epoch,
            tuple(h.author for h in update.contributions),
            update.members,
            update.shard_digests,
            update.cosignatures,
        )

    @property
    def key(self) -> VariantKey:
        return self.shard_digests, self.included

    @property
    def digest(self) -> str:
        """This variant's short name (`variant_digest`): what a group-done notice carries."""
        return variant_digest(self.key)

    def reducers(self) -> tuple[str, ...]:
        if not self.members:
            return self.included
        return ShardPlan(self.members).reducers(self.included)

    def signers(self) -> set[str]:
        """Every key that signed this variant: its included members and its reducers."""
        return set(self.included) | set(self.reducers())

    def statement(self, run_id: str, group_key: str, round_: int, shard: int) -> bytes:
        """What the reducer of `shard` co-signed (merge.group_update.GroupUpdate.statement)."""
        fields = (run_id, group_key, self.epoch, round_)
        digest = self.shard_digests[shard]
        if not self.members:
            return included_statement(fields, list(self.included), shard, digest)
        return sharded_statement(fields, list(self.included), self.members, shard, digest)

    def problem(
        self, run_id: str, group_key: str, round_: int, in_group: Callable[[str], bool]
    ) -> str | None:
        """Why this is no variant every reducer co-signed, or None."""
        inc, members = self.included, self.members
        if not inc or list(inc) != sorted(set(inc)):
            return "malformed"
        if members and (list(members) != sorted(set(members)) or not set(inc) <= set(members)):
            return "malformed"
        shards = len(members) if members else len(inc)
        if not len(self.shard_digests) == len(self.cosignatures) == shards:
            return "malformed"
        if not all(map(in_group, set(inc) | set(members))):
            return "not_a_member"
        for shard, reducer in enumerate(self.reducers()):
            statement = self.statement(run_id, group_key, round_, shard)
            if not verify_signature(reducer, statement, self.cosignatures[shard]):
                return "bad_cosignature"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "included": list(self.included),
            "members": list(self.members),
            "shard_digests": list(self.shard_digests),
            "cosignatures": [s.hex() for s in self.cosignatures],
        }

    @classmethod
    def from_json(cls, obj: object) -> GroupVariant:
        """A variant as received; ProofError("malformed") unless every field is in range."""
        if not isinstance(obj, dict) or set(obj) != _VARIANT_KEYS:
            raise ProofError("malformed", "a variant's fields differ from the expected set")
        epoch = obj["epoch"]
        if type(epoch) is not int or not 0 <= epoch <= MAX_COUNT:
            raise ProofError("malformed", "epoch out of range")
        included, members = _names(obj["included"]), _names(obj["members"])
        digests = _strings(obj["shard_digests"])
        if not all(_HEX64.fullmatch(d) for d in digests):
            raise ProofError("malformed", "a shard digest is not 64 hex characters")
        cosignatures = tuple(_signature(s) for s in _strings(obj["cosignatures"]))
        return cls(epoch, included, members, digests, cosignatures)

    def num_bytes(self) -> int:
        """About what this variant takes in memory (for `AppliedVariants`' budget)."""
        names = sum(len(m) for m in self.included) + sum(len(m) for m in self.members)
        return 256 + names + len(self.shard_digests) * (64 + SIGNATURE_BYTES + 100)


def _strings(obj: object) -> tuple[str, ...]:
    if not isinstance(obj, list) or len(obj) > MAX_PROOF_MEMBERS:
        raise ProofError("malformed", "a list out of range")
    if not all(isinstance(s, str) for s in obj):
        raise ProofError("malformed", "a list of strings holds something else")
    return tuple(obj)


def _names(obj: object) -> tuple[str, ...]:
    names = _strings(obj)
    if not all(0 < len(n) <= MAX_NAME_CHARS for n in names):
        raise ProofError("malformed", "a name out of range")
    return names


def _signature(text: str) -> bytes:
    if len(text) != 2 * SIGNATURE_BYTES:
        raise ProofError("malformed", "a co-signature is not 64 bytes")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise ProofError("malformed", "a co-signature is not hex") from None


def _canonical(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class GroupProof:
    """Two variants of one group round, each co-signed by every reducer of every shard.

    Canonical: the variant whose canonical bytes sort lower first, so every replica that
    holds the same two variants builds the same bytes."""

    run_id: str
    group_key: str
    round: int
    first: GroupVariant
    second: GroupVariant

    @property
    def update_id(self) -> UpdateId:
        """The id replicas apply the group's round under: its group key, its round + 1."""
        return (self.group_key, self.round + 1)

    @property
    def prevailing(self) -> GroupVariant | None:
        """The variant every replica keeps (`prevailing`), or None: equivocation, voided."""
        return prevailing(self.first, self.second)

    @property
    def prevailing_key(self) -> VariantKey | None:
        """The key of the variant that prevails (`prevailing`), or None."""
        kept = self.prevailing
        return None if kept is None else kept.key

    @property
    def superseded_key(self) -> VariantKey | None:
        """The key of the variant the other prevails over (refused everywhere), or None."""
        kept = self.prevailing
        if kept is None:
            return None
        return (self.second if kept is self.first else self.first).key

    @property
    def culprits(self) -> tuple[str, ...]:
        """Members that co-signed both variants (empty: two disjoint included sets)."""
        return tuple(sorted(set(self.first.reducers()) & set(self.second.reducers())))

    @classmethod
    def of(
        cls,
        run_id: str,
        group_key: str,
        round_: int,
        a: GroupVariant,
        b: GroupVariant,
        run: GroupRun,
    ) -> GroupProof:
        """The canonical proof of `a` and `b` (raises ProofError when they prove nothing)."""
        first, second = sorted((a, b), key=lambda v: _canonical(v.to_json()))
        proof = cls(run_id, group_key, round_, first, second)
        proof.check(run)
        return proof

    def check(self, run: GroupRun) -> None:
        """Raises ProofError unless both variants of this round of this run are complete and
        differ (their shard digests or included members)."""
        if self.run_id != run.run_id:
            raise ProofError("wrong_run", "a group round of another run")
        if not 0 < len(self.group_key) <= MAX_NAME_CHARS or not 0 <= self.round < MAX_COUNT:
            raise ProofError("malformed", "group key or round out of range")
        a, b = _canonical(self.first.to_json()), _canonical(self.second.to_json())
        if a >= b or self.first.key == self.second.key:  # equal: no conflict; greater: order
            raise ProofError("not_conflicting", "the two variants do not differ (in order)")
        in_group = run.members_of(self.group_key)
        for variant in (self.first, self.second):
            problem = variant.problem(self.run_id, self.group_key, self.round, in_group)
            if problem is not None:
                raise ProofError(problem, f"a variant of {self.group_key} round {self.round}")

    def signers(self) -> set[str]:
        """Every key that signed either variant (a permissioned run's list must hold each)."""
        return self.first.signers() | self.second.signers()

    def to_bytes(self) -> bytes:
        body = {
            "run_id": self.run_id,
            "group_key": self.group_key,
            "round": self.round,
            "variants": [self.first.to_json(), self.second.to_json()],
        }
        return GROUP_PROOF_MAGIC + _canonical(body)

    @classmethod
    def from_bytes(cls, data: object, run: GroupRun) -> GroupProof:
        """A proof as received, checked; raises ProofError for anything else (bytes that are
        not exactly what `to_bytes` makes of it are refused: one proof, one encoding)."""
        view = proof_bytes(
            data, GROUP_PROOF_MAGIC, MAX_GROUP_PROOF_BYTES, "group proof", "a group's equivocation"
        )
        try:
            body = json.loads(view[len(GROUP_PROOF_MAGIC) :])
        except (ValueError, RecursionError):
            raise ProofError("malformed", "not JSON") from None
        if not isinstance(body, dict) or set(body) != _PROOF_KEYS:
            raise ProofError("malformed", "a proof's fields differ from the expected set")
        run_id, key, round_, variants = (
            body[k] for k in ("run_id", "group_key", "round", "variants")
        )
        if not isinstance(run_id, str) or not isinstance(key, str) or type(round_) is not int:
            raise ProofError("malformed", "run id, group key or round of the wrong type")
        if not isinstance(variants, list) or len(variants) != 2:
            raise ProofError("malformed", "a proof holds two variants")
        first, second = (GroupVariant.from_json(v) for v in variants)
        proof = cls(run_id, key, round_, first, second)
        if proof.to_bytes() != view:
            raise ProofError("not_canonical", "not the canonical encoding")
        proof.check(run)
        return proof


VARIANT_DIGEST_CHARS = 16
"""A variant digest's length in hex characters (64 bits)."""


def variant_digest(key: VariantKey) -> str:
    """A short hash of a variant's co-signed content (its shard digests and included set):
    equal for two copies of one variant, different for two variants of one round (their
    keys differ). Named in a `group-done` notice so a replica that holds another variant of
    the round fetches this one (dht.variant_fetches); a collision only costs that fetch."""
    digest = hashlib.sha256(_canonical([list(key[0]), list(key[1])])).hexdigest()
    return digest[:VARIANT_DIGEST_CHARS]


def prevailing(a: GroupVariant, b: GroupVariant) -> GroupVariant | None:
    """Of two complete variants of one group round, the one every replica keeps: the one
    with more included members (co-signers of the included set), or None when both include
    as many (equivocation: the round is voided, merge.equivocation's rule).

    A variant below the group's quorum cannot void or replace an honest round: the honest
    one includes at least a quorum of the epoch's members, more than the other. A member
    alone can always complete a variant of its own (it contributes, reduces every shard and
    co-signs them, over a member list of its choosing: `GroupUpdate.members` is signed by
    the reducers only, so by it alone); before, any two variants voided the round, so one
    member silenced its group every round. An honest retry (a round completed with 4
    members, then again with 3 after one died) keeps the 4's everywhere. Decided from the
    two variants' signed included sets alone: alike on every replica, in any order.
    No group holds fewer than three members since session 24 (dht.grouping.MIN_MEMBERS:
    in a group of two, one member against the other tied 1 and 1 and voided every round).
    What is not bounded: a Sybil who grinds keys into the group's prefix includes as many
    as it grinds; no count that tells ground keys apart (a co-signer's standing in the
    contribution ledger) is decided alike on every replica at the moment it holds both
    variants (docs/trust.md, "A group round's two variants")."""
    if len(a.included) == len(b.included):
        return None
    return a if len(a.included) > len(b.included) else b


def decode_proof(data: object, fingerprint: str | None, run: GroupRun | None) -> Proof | GroupProof:
    """A proof of either kind as received (its magic says which), checked; ProofError for
    anything else, and for a group's where this replica takes no group updates (`run`)."""
    if isinstance(data, bytes | bytearray) and data.startswith(GROUP_PROOF_MAGIC):
        if run is None:
            raise ProofError("no_groups", "a group's proof where groups are off")
        return GroupProof.from_bytes(data, run)
    return Proof.from_bytes(data, fingerprint)


@dataclass(frozen=True)
class AppliedVariant:
    """A group variant applied here: what a second variant makes a proof with, and what
    withdrawing it takes back (the weight and learner count it stepped with, its co-signers
    credited in the replica's co-sign ledger)."""

    run_id: str
    round: int
    variant: GroupVariant
    weight: float
    learners: int
    credited: float = 1.0
    """The share of it the replica's progress counted (its co-signers' allowance)."""


class AppliedVariants:
    """The variant applied under each recent group id, with its evidence; bounded by count
    (MAX_FIRST_SEEN) and by bytes (MAX_VARIANT_BYTES_HELD), the oldest dropped first. Not
    thread-safe (the merge calls it under the replica's lock)."""

    def __init__(self, size: int = MAX_FIRST_SEEN, max_bytes: int = MAX_VARIANT_BYTES_HELD):
        self._size, self._max_bytes, self._bytes = size, max_bytes, 0
        self._entries: OrderedDict[UpdateId, AppliedVariant] = OrderedDict()

    def applied(self, uid: UpdateId, entry: AppliedVariant) -> None:
        self.forget(uid)
        self._entries[uid] = entry
        self._bytes += entry.variant.num_bytes()
        while self._entries and (len(self._entries) > self._size or self._bytes > self._max_bytes):
            self.forget(next(iter(self._entries)))

    def forget(self, uid: UpdateId) -> None:
        old = self._entries.pop(uid, None)
        if old is not None:
            self._bytes -= old.variant.num_bytes()

    def get(self, uid: UpdateId) -> AppliedVariant | None:
        return self._entries.get(uid)

    def conflict(self, uid: UpdateId, update: GroupUpdate, run: GroupRun) -> GroupProof | None:
        """The proof `update` (verified) makes with the variant applied here under `uid`, if
        they differ and both check out."""
        entry = self._entries.get(uid)
        variant = GroupVariant.of(update)
        if entry is None or entry.variant.key == variant.key:
            return None
        head = update.head
        if (head.run_id, head.group_key, head.round) != (entry.run_id, uid[0], entry.round):
            return None
        try:
            return GroupProof.of(entry.run_id, uid[0], entry.round, entry.variant, variant, run)
        except ProofError:
            return None
