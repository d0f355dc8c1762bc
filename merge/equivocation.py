"""Equivocation: two signed payloads under one update id, its proof, and what every replica does.

An update id (author, seq) names one payload. An author that signs two different payloads
under one id has left evidence anyone can check: the two signed headers, same author and seq,
different payload hashes, both signatures valid. Replicas that received different variants
first would otherwise keep different contributions forever (each applies the id once), so the
rule, the same on every replica whatever it received and in whichever order:

- the id is applied everywhere (applied sets stay equal, as for robust verdicts) and
  contributes nothing: a replica that applied a variant withdraws it ("withdraw"), one that
  did not records the id with no contribution ("record");
- the proof is passed on to peers, so every replica learns it; a replica that learns it again
  does nothing ("none"). A learner group's proof whose prevailing variant this replica holds
  (or that it applied neither variant of) changes nothing here but is still passed on
  ("keep"): rogue25's run had replicas that applied a rogue member's lone variant first
  never learn the proof its group's members formed.

What is withdrawn is the variant's own outer step (the plain share merge.outer applied); what
the momentum already folded in decays like any update's tail, the drift the consistency model
allows. Pure: no network, no replica; merge.pipeline and dht.gossip act on its answers.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from merge.envelope import (
    MAX_HEADER_JSON_BYTES,
    SIGNATURE_BYTES,
    EnvelopeError,
    SignedHeader,
    verify_header,
)

UpdateId = tuple[str, int]
Action = Literal["withdraw", "record", "keep", "none"]
PROOF_MAGIC = b"DLE1"
MAX_HEADER_BLOB = 8 + MAX_HEADER_JSON_BYTES + SIGNATURE_BYTES
MAX_PROOF_BYTES = len(PROOF_MAGIC) + 2 * (4 + MAX_HEADER_BLOB)
MAX_PROOFS = 4096
"""Proofs kept (and persisted); beyond it the oldest are dropped (their ids stay settled in
the applied set)."""
MAX_PROOF_BYTES_HELD = 64 * 2**20
"""Proof bytes kept (a learner group's proof is bigger than a solo one: merge.group_equivocation);
beyond it the oldest are dropped, as beyond MAX_PROOFS."""
MAX_FIRST_SEEN = 8192
"""Signed headers kept to notice a second variant of a recently applied id."""


class Evidence(Protocol):
    """A checked proof of either kind: a solo author's (`Proof`) or a learner group's
    (merge.group_equivocation.GroupProof)."""

    @property
    def update_id(self) -> UpdateId: ...

    def signers(self) -> set[str]: ...

    def to_bytes(self) -> bytes: ...


class Superseding(Protocol):
    """A learner group's proof (merge.group_equivocation.GroupProof): two variants of which
    one may prevail, the other then refused everywhere and nothing voided."""

    @property
    def superseded_key(self) -> VariantKey | None: ...

    @property
    def prevailing_key(self) -> VariantKey | None: ...


VariantKey = tuple[tuple[str, ...], tuple[str, ...]]
"""What tells two variants of one group id apart: shard digests and included members."""


Decoder = Callable[[object, str | None], Evidence]
"""Proof bytes and the run fingerprint -> the checked proof (ProofError for anything else)."""


class ProofError(ValueError):
    """Bytes that are not a valid proof of equivocation; ``reason`` names the failure."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def proof_bytes(data: object, magic: bytes, max_bytes: int, kind: str, of: str) -> bytes:
    """`data` as bytes where it may be a proof of either kind (`kind`, a proof of `of`): bytes
    of at most `max_bytes` that start with its `magic`; ProofError for anything else."""
    if not isinstance(data, bytes | bytearray):
        raise ProofError("malformed", "a proof is bytes")
    if len(data) > max_bytes:
        raise ProofError("too_large", f"{kind} of {len(data)} bytes")
    if not data.startswith(magic):
        raise ProofError("malformed", f"not a proof of {of}")
    return bytes(data)


@dataclass(frozen=True)
class Proof:
    """Two signed headers of one author under one id with different payloads.

    Canonical: the header with the lower payload hash first, so every replica that builds a
    proof of the same pair builds the same bytes.
    """

    first: SignedHeader
    second: SignedHeader

    @property
    def update_id(self) -> UpdateId:
        return self.first.header.update_id

    @classmethod
    def of(cls, a: SignedHeader, b: SignedHeader) -> Proof:
        """The canonical proof of `a` and `b` (raises ProofError when they prove nothing)."""
        first, second = sorted((a, b), key=lambda s: s.header.payload_digest)
        proof = cls(first, second)
        proof.check()
        return proof

    def check(self, fingerprint: str | None = None) -> None:
        """Raises ProofError unless this proves that the author equivocated (in this run)."""
        a, b = self.first.header, self.second.header
        if a.update_id != b.update_id:
            raise ProofError("not_same_id", f"{a.update_id} and {b.update_id}")
        if a.payload_digest >= b.payload_digest:  # equal: no conflict; greater: not canonical
            raise ProofError("not_conflicting", "the payload hashes do not differ (in order)")
        if fingerprint is not None and (a.fingerprint, b.fingerprint) != (fingerprint,) * 2:
            raise ProofError("wrong_run", "a header of another run")
        for signed in (self.first, self.second):
            try:
                verify_header(signed)
            except EnvelopeError as exc:
                raise ProofError(exc.reason, str(exc)) from None

    def signers(self) -> set[str]:
        """The key that signed both headers: the author (a permissioned run's list must hold
        it)."""
        return {self.first.header.author}

    def to_bytes(self) -> bytes:
        parts = [self.first.to_bytes(), self.second.to_bytes()]
        return PROOF_MAGIC + b"".join(struct.pack(">I", len(p)) + p for p in parts)

    @classmethod
    def from_bytes(cls, data: object, fingerprint: str | None = None) -> Proof:
        """A proof as received, checked; raises ProofError for anything else."""
        view = proof_bytes(data, PROOF_MAGIC, MAX_PROOF_BYTES, "proof", "equivocation")
        offset, headers = len(PROOF_MAGIC), []
        for _ in range(2):
            if offset + 4 > len(view):
                raise ProofError("malformed", "truncated")
            (size,) = struct.unpack_from(">I", view, offset)
            offset += 4
            if size > MAX_HEADER_BLOB or offset + size > len(view):
                raise ProofError("malformed", "header length out of range")
            try:
                headers.append(SignedHeader.from_bytes(view[offset : offset + size]))
            except EnvelopeError as exc:
                raise ProofError("malformed", str(exc)) from None
            offset += size
        if offset != len(view):
            raise ProofError("malformed", "trailing bytes")
        proof = cls(headers[0], headers[1])
        proof.check(fingerprint)
        return proof


def admitted_only(decode: Decoder, admit: Callable[[str], bool]) -> Decoder:
    """`decode`, refusing (ProofError "not_allowed") a proof with a signer `admit` refuses: a
    permissioned run's donor hands over no proof of keys off the run's list."""

    def checked(raw: object, fingerprint: str | None) -> Evidence:
        proof = decode(raw, fingerprint)
        if not all(map(admit, proof.signers())):
            raise ProofError("not_allowed", "a signer is not on the run's allow list")
        return proof

    return checked


class EquivocationBook:
    """Proofs known to this replica (an author's, and a learner group's where groups are on:
    merge.group_equivocation), the ids it has settled, and the first signed header of each
    recently applied id (to notice a second variant). Bounded; not thread-safe (the pipeline
    calls it under the replica's lock)."""

    def __init__(self, decode: Decoder | None = None) -> None:
        self.decode: Decoder = decode or Proof.from_bytes
        """How persisted proofs are read back (merge.group_equivocation.decode_proof where
        the replica takes learner groups' updates: both kinds)."""
        self._proofs: OrderedDict[UpdateId, Evidence] = OrderedDict()
        self._bytes = 0
        self._settled: set[UpdateId] = set()
        self._awaiting: set[UpdateId] = set()
        """Ids whose lesser variant this replica applied and withdrew, and whose prevailing
        variant it has not stepped with yet (`withdrew`, `awaits`, `replaced`)."""
        self._first: OrderedDict[UpdateId, tuple[SignedHeader, float, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._proofs)

    def is_equivocated(self, uid: UpdateId) -> bool:
        """Proven and voided: no variant of the id counts (a superseding pair voids none)."""
        return uid in self._proofs and _superseded(self._proofs[uid]) is None

    def refuses(self, uid: UpdateId, variant: VariantKey) -> bool:
        """Whether a group variant of `uid` is refused by what this book holds: every
        variant of an equivocated id, the lesser variant of a superseding pair."""
        proof = self._proofs.get(uid)
        if proof is None:
            return False
        superseded = _superseded(proof)
        return superseded is None or superseded == variant

    def withdrew(self, uid: UpdateId) -> None:
        """The lesser variant of a superseding pair was withdrawn here: the id stays applied,
        and the prevailing variant is stepped with when it comes (`awaits`)."""
        proof = self._proofs.get(uid)
        if proof is not None and _superseded(proof) is not None:
            self._awaiting.add(uid)

    def awaits(self, uid: UpdateId, variant: VariantKey) -> bool:
        """Whether `variant` of the applied id `uid` is to be stepped with in place of the
        lesser variant withdrawn here (Replica.restep), not refused as a duplicate."""
        proof = self._proofs.get(uid)
        if uid not in self._awaiting or proof is None:
            return False
        return _prevailing(proof) == variant

    def replaced(self, uid: UpdateId) -> None:
        """The prevailing variant of `uid` now holds the id's step here."""
        self._awaiting.discard(uid)

    def awaiting(self) -> list[UpdateId]:
        """The ids whose prevailing variant this replica still lacks (to fetch: dht)."""
        return sorted(self._awaiting)

    def proofs(self) -> list[Evidence]:
        return list(self._proofs.values())

    def first_seen(self, signed: SignedHeader, weight: float, learners: int) -> None:
        """`signed` was applied with `weight`, sized by `learners`: a different variant of its
        id later is equivocation, and what was applied can be withdrawn."""
        uid = signed.header.update_id
        self._first[uid] = (signed, weight, learners)
        self._first.move_to_end(uid)
        while len(self._first) > MAX_FIRST_SEEN:
            self._first.popitem(last=False)

    def applied_variant(self, uid: UpdateId) -> tuple[SignedHeader, float, int] | None:
        """The signed header applied under `uid`, its weight and learner count (recent ids)."""
        return self._first.get(uid)

    def conflict(self, signed: SignedHeader) -> Proof | None:
        """The proof that `signed` makes with the variant applied under its id, if they differ
        (and `signed` is validly signed)."""
        entry = self._first.get(signed.header.update_id)
        if entry is None or entry[0].header.payload_digest == signed.header.payload_digest:
            return None
        first = entry[0]
        try:
            return Proof.of(first, signed)
        except ProofError:
            return None

    def learn(
        self, proof: Evidence, *, applied: bool, applied_variant: VariantKey | None = None
    ) -> Action:
        """What this replica does on (possibly again) learning `proof`; `applied`: whether the
        id is in its applied set now (`applied_variant`: the group variant applied under it,
        where known). The caller carries the action out, then calls `settled`.

        A learner group's pair of which one variant prevails (merge.group_equivocation
        `prevailing`) voids nothing: the lesser variant is withdrawn where it was applied
        (its id stays applied), the prevailing one kept, and the lesser refused from now on
        (`refuses`); a replica that applied neither takes the prevailing one when it comes."""
        uid = proof.update_id
        kept = self._proofs.get(uid)
        before = None if kept is None else _superseded(kept)
        voids = kept is not None and before is None
        if uid in self._settled and (voids or _superseded(proof) is not None):
            return "none"
        if not voids:
            self._keep(proof)  # a voiding pair replaces a superseding one, never back
        superseded = _superseded(self._proofs[uid])
        if superseded is None:
            self._awaiting.discard(uid)  # voided: no variant of it steps any more
        if superseded is not None:
            return "withdraw" if applied and applied_variant == superseded else "keep"
        if applied and before is not None and applied_variant == before:
            return "none"  # the lesser variant applied here is withdrawn already
        return "withdraw" if applied else "record"

    def _keep(self, proof: Evidence) -> None:
        replaced = self._proofs.pop(proof.update_id, None)
        if replaced is not None:
            self._bytes -= len(replaced.to_bytes())
        self._proofs[proof.update_id] = proof
        self._bytes += len(proof.to_bytes())
        while len(self._proofs) > MAX_PROOFS or self._bytes > MAX_PROOF_BYTES_HELD:
            old, dropped = self._proofs.popitem(last=False)
            self._bytes -= len(dropped.to_bytes())
            self._settled.discard(old)
            self._awaiting.discard(old)

    def settled(self, uid: UpdateId) -> None:
        """The id's contribution is gone from this replica (withdrawn, or recorded as none)."""
        if uid in self._proofs:
            self._settled.add(uid)

    def state_dict(self) -> dict[str, object]:
        """Proof bytes and the settled ids: checkpointed with the replica they describe."""
        return {
            "proofs": [p.to_bytes() for p in self._proofs.values()],
            "settled": sorted([a, s] for a, s in self._settled),
            "awaiting": [[a, s] for a, s in sorted(self._awaiting)],
        }

    def load_state_dict(self, state: object, fingerprint: str | None = None) -> None:
        """Restores what `state_dict` saved (proofs as bytes or hex); entries that do not
        check out are skipped, and what any other input holds is never raised on."""
        self._proofs.clear()
        self._bytes = 0
        self._settled.clear()
        self._awaiting.clear()
        if not isinstance(state, dict):
            return
        proofs, settled = state.get("proofs"), state.get("settled")
        awaiting = state.get("awaiting")
        for blob in (proofs if isinstance(proofs, list) else [])[-MAX_PROOFS:]:
            try:  # hex: a state transfer's JSON tree (merge.pipeline_state.transfer_state)
                raw = bytes.fromhex(blob) if isinstance(blob, str) else blob
                proof = self.decode(raw, fingerprint)
            except (ProofError, ValueError):
                continue
            self._keep(proof)
        for entry in settled if isinstance(settled, list) else []:
            if isinstance(entry, list | tuple) and len(entry) == 2 and type(entry[1]) is int:
                uid = (str(entry[0]), entry[1])
                if uid in self._proofs:
                    self._settled.add(uid)
        for entry in awaiting if isinstance(awaiting, list) else []:  # absent: none (before)
            if isinstance(entry, list | tuple) and len(entry) == 2 and type(entry[1]) is int:
                self.withdrew((str(entry[0]), entry[1]))


def _superseded(proof: Evidence) -> VariantKey | None:
    """The variant a learner group's proof supersedes, or None (a voiding proof, solo ones)."""
    key: VariantKey | None = getattr(proof, "superseded_key", None)
    return key


def _prevailing(proof: Evidence) -> VariantKey | None:
    """The variant a learner group's proof keeps, or None (a voiding proof, solo ones)."""
    key: VariantKey | None = getattr(proof, "prevailing_key", None)
    return key


class GroupVariants:
    """Learner groups' updates applied here, by id (group key, round + 1): a second variant of
    one id, whose every signature holds too, is equivocation by the members that co-signed
    both (or, two disjoint included sets, by the group). Detected and counted here; the proof
    that settles it alike on every replica, the two variants as their reducers co-signed them,
    is merge.group_equivocation's (docs/scale.md, wiring plan step 5). Pure; the newest
    MAX_FIRST_SEEN ids are remembered."""

    def __init__(self, size: int = MAX_FIRST_SEEN) -> None:
        self._size = size
        self._applied: OrderedDict[UpdateId, tuple[tuple[str, ...], tuple[str, ...]]] = (
            OrderedDict()
        )
        """Per id: the applied variant's shard digests and its included members."""

    def applied(
        self, uid: UpdateId, shard_digests: tuple[str, ...], included: tuple[str, ...]
    ) -> None:
        self._applied[uid] = (shard_digests, included)
        self._applied.move_to_end(uid)
        while len(self._applied) > self._size:
            self._applied.popitem(last=False)

    def key_of(self, uid: UpdateId) -> VariantKey | None:
        """The variant applied under `uid` (recent ids), or None."""
        return self._applied.get(uid)

    def equivocators(
        self, uid: UpdateId, shard_digests: tuple[str, ...], included: tuple[str, ...]
    ) -> tuple[str, ...] | None:
        """For a verified variant of an id applied here: None when it is the same variant (or
        the id is not remembered), else the members that co-signed both (sorted; empty when
        the two included sets share no member: two disjoint quorums, each signed honestly
        by its own members, which only a group larger than two quorums can produce)."""
        known = self._applied.get(uid)
        if known is None or (known[0], known[1]) == (shard_digests, included):
            return None
        return tuple(sorted(set(known[1]) & set(included)))
