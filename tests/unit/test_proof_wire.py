"""Proofs of equivocation keep their wire format: bytes encoded before session 22 (one solo
author's, one learner group's, in tests/unit/data/proofs_v1.json) parse to the proofs the
same keys and tensors build today and encode back to the same bytes, and what is no proof is
refused with the same reason and message as before."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from merge.equivocation import MAX_PROOF_BYTES, PROOF_MAGIC, Proof, ProofError
from merge.group_equivocation import (
    GROUP_PROOF_MAGIC,
    MAX_GROUP_PROOF_BYTES,
    GroupProof,
    GroupVariant,
    decode_proof,
)
from merge.group_update import tensor_digest
from tests.factories import FINGERPRINT
from tests.unit.proof_wire_cases import GROUP_RUN, MEMBERS, group_proof, group_updates, solo_proof

GOLDEN = json.loads((Path(__file__).parent / "data" / "proofs_v1.json").read_text())
SOLO, GROUP = bytes.fromhex(GOLDEN["solo"]), bytes.fromhex(GOLDEN["group"])


def test_a_solo_proof_made_before_parses_the_same_and_encodes_back() -> None:
    parsed = Proof.from_bytes(SOLO, FINGERPRINT)
    assert parsed == solo_proof()
    assert parsed.to_bytes() == SOLO
    assert decode_proof(SOLO, FINGERPRINT, GROUP_RUN) == parsed


def test_a_group_proof_made_before_parses_the_same_and_encodes_back() -> None:
    """Its shard digests are session 26's (SHA-256 of `tensor_split` shards), today's chunk
    roots (session 27): the proof is the one those keys and tensors built then."""
    parsed = GroupProof.from_bytes(GROUP, GROUP_RUN)
    today = group_proof()
    assert (parsed.run_id, parsed.group_key, parsed.round) == (
        today.run_id, today.group_key, today.round,
    )  # fmt: skip
    for old, update in zip((parsed.first, parsed.second), group_updates(), strict=True):
        pieces = torch.tensor_split(update.aggregate, update.num_shards)
        assert old.shard_digests == tuple(tensor_digest(p) for p in pieces)
        assert old == dataclasses.replace(
            GroupVariant.of(update), shard_digests=old.shard_digests, cosignatures=old.cosignatures
        )
    assert parsed.to_bytes() == GROUP
    assert decode_proof(GROUP, FINGERPRINT, GROUP_RUN) == parsed
    assert parsed.culprits == (MEMBERS[0].peer_id,)  # the member in both included sets


SOLO_DECODE = functools.partial(Proof.from_bytes, fingerprint=FINGERPRINT)
GROUP_DECODE = functools.partial(GroupProof.from_bytes, run=GROUP_RUN)


@pytest.mark.parametrize(
    ("decode", "data", "reason", "message"),
    [
        (SOLO_DECODE, "not bytes", "malformed", "malformed: a proof is bytes"),
        (
            SOLO_DECODE, b"x" * (MAX_PROOF_BYTES + 1), "too_large",
            f"too_large: proof of {MAX_PROOF_BYTES + 1} bytes",
        ),
        (SOLO_DECODE, b"DLX1" + SOLO[4:], "malformed", "malformed: not a proof of equivocation"),
        (SOLO_DECODE, PROOF_MAGIC + b"\0\0", "malformed", "malformed: truncated"),
        (SOLO_DECODE, SOLO + b"\0", "malformed", "malformed: trailing bytes"),
        (GROUP_DECODE, None, "malformed", "malformed: a proof is bytes"),
        (
            GROUP_DECODE, GROUP_PROOF_MAGIC + b" " * MAX_GROUP_PROOF_BYTES, "too_large",
            f"too_large: group proof of {MAX_GROUP_PROOF_BYTES + len(GROUP_PROOF_MAGIC)} bytes",
        ),
        (
            GROUP_DECODE, b"DLX1" + GROUP[4:], "malformed",
            "malformed: not a proof of a group's equivocation",
        ),
        (GROUP_DECODE, GROUP_PROOF_MAGIC + b"{", "malformed", "malformed: not JSON"),
        (
            GROUP_DECODE, GROUP[:-1] + b" }", "not_canonical",
            "not_canonical: not the canonical encoding",
        ),
    ],
    ids=[
        "solo_not_bytes", "solo_too_large", "solo_wrong_magic", "solo_truncated", "solo_trailing",
        "group_not_bytes", "group_too_large", "group_wrong_magic", "group_not_json",
        "group_not_canonical",
    ],
)  # fmt: skip
def test_what_is_no_proof_is_refused_as_before(
    decode: Callable[[object], object], data: object, reason: str, message: str
) -> None:
    with pytest.raises(ProofError) as refused:
        decode(data)
    assert (refused.value.reason, str(refused.value)) == (reason, message)
