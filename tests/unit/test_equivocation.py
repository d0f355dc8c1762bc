"""Equivocation: the proof, the book's decisions, and replicas converging on one contribution."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.envelope import SignedHeader, SignedUpdate
from merge.equivocation import MAX_PROOF_BYTES, EquivocationBook, Proof, ProofError
from merge.outer import OuterConfig
from merge.pipeline import MergeConfig, UpdatePipeline
from tests.unit.test_merge_pipeline import (
    ALICE,
    BOB,
    CONFIG,
    FINGERPRINT,
    make_pipeline,
    make_update,
)

A = make_update(delta=[0.5, 0.0, -0.5, 1.0], seq=3, learners=4)
B = make_update(delta=[0.25, 0.5, 0.0, 0.5], seq=3, learners=4)


def proof() -> Proof:
    return Proof.of(A.signed_header, B.signed_header)


def test_a_proof_is_canonical_and_round_trips() -> None:
    one, other = (
        Proof.of(A.signed_header, B.signed_header),
        Proof.of(B.signed_header, A.signed_header),
    )
    assert one.to_bytes() == other.to_bytes()
    assert Proof.from_bytes(one.to_bytes(), FINGERPRINT) == one
    assert one.update_id == (ALICE.peer_id, 3)
    assert len(one.to_bytes()) <= MAX_PROOF_BYTES


@pytest.mark.parametrize(
    ("a", "b", "reason"),
    [
        (A, A, "not_conflicting"),  # one payload: no equivocation
        (A, make_update(delta=[1.0, 1.0, 1.0, 1.0], seq=4), "not_same_id"),
        (A, make_update(BOB, seq=3), "not_same_id"),
    ],
)
def test_headers_that_prove_nothing_are_refused(
    a: SignedUpdate, b: SignedUpdate, reason: str
) -> None:
    with pytest.raises(ProofError) as exc:
        Proof.of(a.signed_header, b.signed_header)
    assert exc.value.reason == reason


def test_a_forged_or_foreign_proof_is_refused() -> None:
    # Bob signs a header naming Alice: the signature check fails, Alice is not implicated.
    field = "payload_blake3" if B.header.payload_blake3 else "payload_sha256"
    forged_header = dataclasses.replace(B.header, **{field: "f" * 64})
    forged = SignedHeader(forged_header, BOB.sign(forged_header.canonical_bytes()))
    with pytest.raises(ProofError) as exc:
        Proof.of(A.signed_header, forged)
    assert exc.value.reason == "bad_signature"
    with pytest.raises(ProofError) as exc:
        Proof.from_bytes(proof().to_bytes(), "0" * 64)
    assert exc.value.reason == "wrong_run"


@settings(max_examples=60, deadline=None)
@given(
    st.binary(max_size=600)
    | st.integers(0, len(proof().to_bytes()) - 1).map(lambda cut: proof().to_bytes()[:cut])
)
def test_arbitrary_and_truncated_bytes_raise_only_proof_errors(data: bytes) -> None:
    with pytest.raises(ProofError):
        Proof.from_bytes(data, FINGERPRINT)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 255))
def test_mutated_proofs_are_refused_or_still_prove_the_same_id(position: int, byte: int) -> None:
    blob = bytearray(proof().to_bytes())
    blob[position % len(blob)] = byte
    try:
        mutated = Proof.from_bytes(bytes(blob), FINGERPRINT)
    except ProofError:
        return
    assert mutated.update_id == proof().update_id  # only bytes no signature covers changed


def test_the_book_decides_once_per_id() -> None:
    book = EquivocationBook()
    assert book.learn(proof(), applied=True) == "withdraw"
    book.settled(proof().update_id)
    assert book.learn(proof(), applied=True) == "none"
    assert book.is_equivocated(proof().update_id)
    other = EquivocationBook()
    assert other.learn(proof(), applied=False) == "record"


def test_the_book_notices_a_second_variant_of_an_applied_id() -> None:
    book = EquivocationBook()
    book.first_seen(A.signed_header, 0.5, 4)
    assert book.conflict(A.signed_header) is None
    found = book.conflict(B.signed_header)
    assert found is not None and found.to_bytes() == proof().to_bytes()


def test_the_book_survives_a_checkpoint_and_drops_bad_entries() -> None:
    book = EquivocationBook()
    book.learn(proof(), applied=False)
    book.settled(proof().update_id)
    state = book.state_dict()
    state["proofs"] = [*state["proofs"], b"junk"]  # type: ignore[misc]
    restored = EquivocationBook()
    restored.load_state_dict(state, FINGERPRINT)
    assert restored.is_equivocated(proof().update_id) and len(restored) == 1
    assert restored.learn(proof(), applied=True) == "none"
    restored.load_state_dict("not a dict")
    assert len(restored) == 0


DELAYED = dataclasses.replace(
    CONFIG, outer=OuterConfig(kind="delayed_nesterov", lr=0.5, momentum=0.5)
)


def _retained(update: SignedUpdate) -> Callable[..., SignedUpdate | None]:
    return lambda header: update if header.update_id == update.header.update_id else None


@pytest.mark.parametrize("config", [CONFIG, DELAYED], ids=["nesterov", "delayed_nesterov"])
def test_replicas_that_applied_different_variants_converge_on_the_proof(
    config: MergeConfig,
) -> None:
    """One replica got A first, one B, one neither: after the proof all three hold the id with
    no contribution; the parameters agree exactly up to the momentum (here: exactly, no fold)."""
    first, second, third = make_pipeline(config), make_pipeline(config), make_pipeline(config)
    base = make_update(BOB, seq=1, learners=4)  # some history before, the same everywhere
    for p in (first, second, third):
        assert p.submit(base).accepted
    assert first.submit(A).accepted and second.submit(B).accepted
    gap_before = float(torch.linalg.vector_norm(first.replica.params - second.replica.params))
    assert gap_before > 0
    # Each sees the other's variant: equivocation, and the proof it makes.
    assert first.submit(B).reason == "equivocation"
    evidence = first.evidence(B.signed_header)
    assert evidence is not None

    assert first.rejections["equivocation"] == 1
    assert first.learn_proof(evidence, _retained(A)) == "withdraw"
    assert second.learn_proof(evidence, _retained(B)) == "withdraw"
    assert third.learn_proof(evidence, _retained(A)) == "record"
    assert first.rejections["equivocation"] == 2  # the second variant, then the proof
    for p in (first, second, third):
        assert p.learn_proof(evidence, _retained(A)) == "none"  # told again: nothing more
        assert p.replica.applied_digest() == third.replica.applied_digest()
        assert p.submit(A).reason in ("equivocation", "duplicate")
    if config.outer.kind == "delayed_nesterov":  # plain steps only: exactly withdrawn
        torch.testing.assert_close(first.replica.params, third.replica.params)
        torch.testing.assert_close(second.replica.params, third.replica.params)
    else:  # the momentum keeps a tail of what was withdrawn; far smaller than the variants' gap
        for p in (first, second):
            gap = float(torch.linalg.vector_norm(p.replica.params - third.replica.params))
            assert gap < 0.5 * gap_before


def test_a_proof_of_another_run_or_author_changes_nothing() -> None:
    pipeline = make_pipeline()
    assert pipeline.submit(A).accepted
    before = pipeline.replica.params.clone()
    with pytest.raises(ProofError):
        Proof.from_bytes(proof().to_bytes(), "0" * 64)
    assert torch.equal(pipeline.replica.params, before)
    assert pipeline.submit(make_update(BOB, seq=3)).accepted  # Bob's seq 3 is Bob's own


def test_a_withdrawn_payload_that_is_gone_leaves_the_id_applied() -> None:
    pipeline: UpdatePipeline = make_pipeline()
    assert pipeline.submit(A).accepted
    assert pipeline.learn_proof(proof(), lambda header: None) == "withdraw"
    assert pipeline.replica.has_applied(ALICE.peer_id, 3)
