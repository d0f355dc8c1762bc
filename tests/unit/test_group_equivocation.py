"""Proofs of a learner group's equivocation (merge.group_equivocation, docs/scale.md wiring plan
step 5): two variants of one group round, each co-signed by every reducer, are evidence any
replica checks alone; every replica that learns it ends with the id applied and contributing
nothing, whichever variant it applied first or none; forged proofs change nothing."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import group_key, member_check, peer_bits
from dht.grouping_wire import MAX_MEMBERS, MAX_TEXT
from merge.equivocation import EquivocationBook, ProofError, UpdateId
from merge.group_equivocation import (
    GROUP_PROOF_MAGIC,
    MAX_GROUP_PROOF_BYTES,
    MAX_NAME_CHARS,
    MAX_PROOF_MEMBERS,
    GroupProof,
    GroupRun,
    GroupVariant,
    decode_proof,
)
from merge.group_update import GroupUpdate
from merge.identity import Identity
from merge.outer import OuterConfig, make_outer_optimizer
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.replica import Replica
from merge.shard_round import Incoming, ShardRound, part_gram, state_tensors, summed_gram
from tests.factories import FINGERPRINT
from tests.unit.test_group_merge import CONFIG, IDS, NUMEL, RUN, _update

THE_RUN = GroupRun(RUN, functools.partial(member_check, RUN))
DELAYED = dataclasses.replace(
    CONFIG, outer=OuterConfig(kind="delayed_nesterov", lr=0.5, momentum=0.5)
)
# One round, two included sets of three, both complete: neither prevails (equivocation).
A, B = _update(IDS[:3]), _update([IDS[0], IDS[1], IDS[3]], scale=2.0)
LESSER = _update(IDS[:2])
"""A complete variant of A's round including fewer members (A prevails over it)."""
UID = (A.head.group_key, A.seq)


def _pipeline(config: MergeConfig = DELAYED) -> UpdatePipeline:
    start = torch.linspace(1.0, 2.0, NUMEL)
    replica = Replica(start, make_outer_optimizer(config.outer, NUMEL))
    pipeline = UpdatePipeline(replica, config, FINGERPRINT)
    pipeline.enable_groups(RUN, functools.partial(member_check, RUN))
    return pipeline


def _proof(a: GroupUpdate = A, b: GroupUpdate = B) -> GroupProof:
    g = a.head
    variants = GroupVariant.of(a), GroupVariant.of(b)
    return GroupProof.of(RUN, g.group_key, g.round, *variants, THE_RUN)


def _retained(update: GroupUpdate | None) -> Callable[[UpdateId], GroupUpdate | None]:
    """The variant a replica applied, as its retained copy gives it back (None: none)."""
    return lambda uid: update if uid == UID else None


def _unchecked(a: GroupVariant, b: GroupVariant) -> GroupProof:
    """A proof of `a` and `b` in canonical order, not checked (to see what `check` says)."""
    first, second = sorted(
        (a, b), key=lambda v: json.dumps(v.to_json(), sort_keys=True, separators=(",", ":"))
    )
    return GroupProof(RUN, "groups.0b", 2, first, second)


def test_a_proof_is_canonical_round_trips_and_names_who_cosigned_both() -> None:
    proof = _proof()
    assert _proof(B, A).to_bytes() == proof.to_bytes()  # whichever variant a replica had first
    assert GroupProof.from_bytes(proof.to_bytes(), THE_RUN) == proof
    assert decode_proof(proof.to_bytes(), FINGERPRINT, THE_RUN) == proof
    assert proof.update_id == UID == ("groups.0b", 3)
    assert proof.culprits == tuple(sorted(m.peer_id for m in IDS[:2]))
    assert len(proof.to_bytes()) < 4096  # a group of three: a few KiB


def test_the_bounds_are_the_wire_bounds_of_a_group_update() -> None:
    assert (MAX_PROOF_MEMBERS, MAX_NAME_CHARS) == (MAX_MEMBERS, MAX_TEXT)


def test_two_disjoint_included_sets_prove_the_groups_equivocation_with_no_culprit() -> None:
    proof = _proof(_update(IDS[:2]), _update(IDS[2:4]))
    assert proof.culprits == ()
    assert GroupProof.from_bytes(proof.to_bytes(), THE_RUN) == proof


def _sharded(included: list[Identity], members: list[Identity], digest: str) -> GroupVariant:
    """A reduce-scatter variant: one shard per listed member, co-signed by its reducer."""
    names = tuple(sorted(m.peer_id for m in members))
    unsigned = GroupVariant(
        0, tuple(sorted(m.peer_id for m in included)), names, (digest,) * len(names), ()
    )
    keys = {m.peer_id: m for m in members}
    signatures = tuple(
        keys[reducer].sign(unsigned.statement(RUN, "groups.0b", 2, shard))
        for shard, reducer in enumerate(unsigned.reducers())
    )
    return dataclasses.replace(unsigned, cosignatures=signatures)


def test_reduce_scatter_variants_prove_it_by_their_reducers_cosignatures() -> None:
    a, b = _sharded(IDS[:3], IDS, "a" * 64), _sharded(IDS[1:4], IDS, "a" * 64)
    proof = GroupProof.of(RUN, "groups.0b", 2, a, b, THE_RUN)
    assert GroupProof.from_bytes(proof.to_bytes(), THE_RUN) == proof
    assert proof.culprits == tuple(sorted(m.peer_id for m in IDS[1:3]))
    forged = dataclasses.replace(b, members=b.members[:3])  # another split than was signed
    with pytest.raises(ProofError) as caught:
        GroupProof.of(RUN, "groups.0b", 2, a, forged, THE_RUN)
    assert caught.value.reason in {"bad_cosignature", "malformed"}


def _reason(proof: GroupProof, run: GroupRun = THE_RUN) -> str:
    with pytest.raises(ProofError) as caught:
        proof.check(run)
    return caught.value.reason


def test_the_same_variant_twice_proves_nothing() -> None:
    a = GroupVariant.of(A)
    assert _reason(GroupProof(RUN, "groups.0b", 2, a, a)) == "not_conflicting"
    other_epoch = dataclasses.replace(a, epoch=1)  # not a variant: the same included set
    assert _reason(GroupProof(RUN, "groups.0b", 2, a, other_epoch)) == "not_conflicting"


def test_a_proof_of_another_run_is_refused() -> None:
    proof = _proof()
    other = GroupRun("another-run", functools.partial(member_check, "another-run"))
    assert _reason(proof, other) == "wrong_run"
    relabelled = dataclasses.replace(proof, run_id="another-run")  # signed for RUN
    assert _reason(relabelled, other) == "bad_cosignature"
    with pytest.raises(ProofError):
        GroupProof.from_bytes(proof.to_bytes(), other)


def test_a_proof_signed_by_a_non_member_is_refused() -> None:
    """A key the variants' signers are outside of; and an outsider's own one-member variant
    of a group's round, beside the group's real one."""
    nobody = GroupRun(RUN, lambda key: lambda peer: False)
    assert _reason(_proof(), nobody) == "not_a_member"
    inside = [m for m in IDS if peer_bits(RUN, m.peer_id)[0] == "0"]
    while len(inside) < 2:
        member = Identity.generate()
        if peer_bits(RUN, member.peer_id)[0] == "0":
            inside.append(member)
    outsider = Identity.generate()
    while peer_bits(RUN, outsider.peer_id)[0] != "1":
        outsider = Identity.generate()
    key = group_key("0")
    real, forged = _update(inside[:2], key=key), _update([outsider], key=key)
    with pytest.raises(ProofError) as caught:
        GroupProof.of(RUN, key, 2, GroupVariant.of(real), GroupVariant.of(forged), THE_RUN)
    assert caught.value.reason == "not_a_member"


def test_a_variant_not_every_reducer_cosigned_is_refused() -> None:
    """One member's second co-signature (as it makes when its round retries without a lost
    member) is not a variant: the others did not co-sign it, so it proves nothing."""
    a, b = GroupVariant.of(A), GroupVariant.of(LESSER)
    lone = dataclasses.replace(b, cosignatures=(b.cosignatures[0], b.cosignatures[0]))
    assert _reason(_unchecked(a, lone)) == "bad_cosignature"
    missing = dataclasses.replace(b, cosignatures=b.cosignatures[:1])
    assert _reason(_unchecked(a, missing)) == "malformed"


def test_bytes_that_are_not_one_canonical_proof_are_refused() -> None:
    blob = _proof().to_bytes()
    body = json.loads(blob[len(GROUP_PROOF_MAGIC) :])
    spaced = GROUP_PROOF_MAGIC + json.dumps(body, sort_keys=True).encode()
    with pytest.raises(ProofError, match="not_canonical"):
        GroupProof.from_bytes(spaced, THE_RUN)
    body["variants"].reverse()
    swapped = GROUP_PROOF_MAGIC + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    with pytest.raises(ProofError, match="not_conflicting"):
        GroupProof.from_bytes(swapped, THE_RUN)
    with pytest.raises(ProofError, match="too_large"):
        GroupProof.from_bytes(GROUP_PROOF_MAGIC + b" " * MAX_GROUP_PROOF_BYTES, THE_RUN)
    with pytest.raises(ProofError, match="no_groups"):
        decode_proof(blob, FINGERPRINT, None)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_raise_only_proof_errors(data: bytes) -> None:
    for blob in (data, GROUP_PROOF_MAGIC + data):
        with pytest.raises(ProofError):
            decode_proof(blob, FINGERPRINT, THE_RUN)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(JSON)
def test_arbitrary_json_raises_only_proof_errors(body: object) -> None:
    with pytest.raises(ProofError):
        GroupProof.from_bytes(GROUP_PROOF_MAGIC + json.dumps(body).encode(), THE_RUN)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_a_corrupted_or_truncated_proof_is_refused(data: st.DataObject) -> None:
    """Any one byte changed, or the proof cut short, is no proof: every field is signed,
    checked or fixed by the canonical encoding."""
    blob = bytearray(_PROOF_BYTES)
    position = data.draw(st.integers(0, len(blob) - 1))
    blob[position] = (blob[position] + data.draw(st.integers(1, 255))) % 256
    with pytest.raises(ProofError):
        GroupProof.from_bytes(bytes(blob), THE_RUN)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(ProofError):
        GroupProof.from_bytes(_PROOF_BYTES[:cut], THE_RUN)


_PROOF_BYTES = _proof().to_bytes()


def _apply(pipeline: UpdatePipeline, update: GroupUpdate) -> bool:
    return pipeline.submit_group(update, member_check(RUN, update.head.group_key)).accepted


def test_a_replica_that_applied_one_variant_builds_the_proof_from_the_other() -> None:
    for first, second in ((A, B), (B, A)):
        pipeline = _pipeline()
        assert _apply(pipeline, first) and not _apply(pipeline, second)
        assert pipeline.rejections["group_equivocation"] == 1
        assert pipeline.group_evidence(second) == _proof()
        assert pipeline.group_evidence(first) is None  # the applied variant itself: nothing


EVENTS = st.permutations(["A", "B", "proof"]).flatmap(
    lambda order: st.lists(st.booleans(), min_size=3, max_size=3).map(
        lambda keep: [e for e, k in zip(order, keep, strict=True) if k or e == "proof"]
    )
)


@settings(max_examples=20, deadline=None)
@given(st.lists(EVENTS, min_size=3, max_size=3))
def test_replicas_end_alike_whichever_variant_they_applied_and_in_any_order(
    schedules: list[list[str]],
) -> None:
    """Each replica hears A, B (or neither) and the proof in its own order: all end with the
    id applied and contributing nothing (the params of a replica that never saw it, the
    co-signers uncredited); the proof told again changes nothing, no variant is taken after."""
    proof, untouched = _proof(), _pipeline()
    variants = {"A": A, "B": B}
    replicas = []
    for schedule in schedules:
        pipeline, applied = _pipeline(), None
        for event in schedule:
            if event == "proof":
                pipeline.learn_group_proof(proof, _retained(applied))
            elif _apply(pipeline, variants[event]) and applied is None:
                applied = variants[event]
        replicas.append(pipeline)
        assert pipeline.learn_group_proof(proof, _retained(applied)) == "none"
        assert not _apply(pipeline, A) and not _apply(pipeline, B)
    for pipeline in replicas:
        assert pipeline.replica.has_applied(*UID)
        assert pipeline.replica.applied_digest() == replicas[0].replica.applied_digest()
        assert pipeline.replica.cosigned.counts() == {}
        torch.testing.assert_close(pipeline.replica.params, untouched.replica.params)
        assert pipeline.equivocation.is_equivocated(UID)


def test_with_momentum_only_the_tail_of_a_withdrawn_variant_is_left() -> None:
    """Nesterov: what momentum built on the withdrawn variant decays like any update's tail;
    the replicas are far nearer each other than the two variants kept them."""
    history = _update(IDS[:3], round_=1)
    first, second, third = _pipeline(CONFIG), _pipeline(CONFIG), _pipeline(CONFIG)
    for pipeline in (first, second, third):
        assert _apply(pipeline, history)
    assert _apply(first, A) and _apply(second, B)
    gap = float(torch.linalg.vector_norm(first.replica.params - second.replica.params))
    proof = first.group_evidence(B)
    assert proof is not None and gap > 0
    assert first.learn_group_proof(proof, _retained(A)) == "withdraw"
    assert second.learn_group_proof(proof, _retained(B)) == "withdraw"
    assert third.learn_group_proof(proof, _retained(None)) == "record"
    for pipeline in (first, second):
        left = float(torch.linalg.vector_norm(pipeline.replica.params - third.replica.params))
        assert left < 0.5 * gap
        assert pipeline.replica.applied_digest() == third.replica.applied_digest()
        assert pipeline.replica.cosigned.counts() == third.replica.cosigned.counts()


def test_a_variant_whose_aggregate_is_gone_is_kept_and_its_id_settled() -> None:
    pipeline = _pipeline()
    assert _apply(pipeline, A)
    before = pipeline.replica.params.clone()
    assert pipeline.learn_group_proof(_proof(), _retained(None)) == "withdraw"
    assert torch.equal(pipeline.replica.params, before)  # logged: nothing to withdraw with
    assert pipeline.learn_group_proof(_proof(), _retained(A)) == "none"


def test_group_proofs_are_kept_with_the_solo_ones_through_a_checkpoint_and_a_transfer() -> None:
    donor = _pipeline()
    assert _apply(donor, A)
    assert donor.learn_group_proof(_proof(), _retained(A)) == "withdraw"
    book = EquivocationBook(donor.equivocation.decode)
    book.load_state_dict(donor.equivocation.state_dict(), FINGERPRINT)
    assert book.is_equivocated(UID) and book.learn(_proof(), applied=True) == "none"
    no_groups = EquivocationBook()  # a replica without groups reads no group proof back
    no_groups.load_state_dict(donor.equivocation.state_dict(), FINGERPRINT)
    assert len(no_groups) == 0
    newcomer = _pipeline()
    newcomer.adopt(donor.transfer_state())
    assert newcomer.equivocation.is_equivocated(UID)
    assert newcomer.learn_group_proof(_proof(), _retained(None)) == "none"
    assert not _apply(newcomer, B)


def test_a_replica_without_groups_settles_no_group_proof() -> None:
    pipeline = _pipeline()
    pipeline.group_run = None
    assert pipeline.learn_group_proof(_proof(), _retained(None)) == "none"
    assert not pipeline.replica.has_applied(*UID)


def test_a_variant_applied_by_the_sharded_round_makes_a_proof_with_a_second_one() -> None:
    """merge.shard_round applies a round of group updates as one step: the variant it applied
    is kept as the whole path keeps it, so a second variant of its id makes the same proof
    here (passed on; the replicas that applied a variant whole withdraw it)."""
    pipeline = _pipeline()
    rounds = ShardRound(pipeline.groups)
    incoming = rounds.order([Incoming.of(pipeline.groups, A, THE_RUN.members_of(UID[0]))])
    states = state_tensors(pipeline.replica)  # one member holding the whole model
    plan = rounds.decide(incoming, summed_gram([part_gram([*states, A.aggregate])]))
    gathered = ShardRound.weighted_sums(plan, [A.aggregate])
    assert [r.accepted for r in rounds.apply(plan, gathered)] == [True]
    proof = pipeline.group_evidence(B)
    assert proof is not None and proof.to_bytes() == _proof().to_bytes()
    assert pipeline.group_evidence(A) is None  # the variant it applied proves nothing
