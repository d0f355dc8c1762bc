"""bench.adversary_group's lone variant, built with the honest members' own classes: a
complete group update that every replica's checks take (it is signed by a key in the group's
prefix), of the honest round's id, that loses to the honest round in a proof and is refused
after it (merge.group_equivocation `prevailing`)."""

from __future__ import annotations

import torch

from bench.adversary_group import lone_variant
from dht.grouping import member_check
from merge.group_equivocation import GroupProof, GroupVariant, prevailing
from merge.group_update import ContributionHeader, GroupReduction, GroupUpdate, RoundFields
from merge.identity import Identity
from tests.unit.test_group_equivocation import THE_RUN, _pipeline
from tests.unit.test_group_merge import IDS, NUMEL, RUN, _update

ROGUE = Identity.generate()


def _lone(honest_round: int = 2) -> tuple[GroupUpdate, GroupUpdate]:
    before = _update(IDS[:3], round_=honest_round - 1)
    honest = _update(IDS[:3], round_=honest_round)
    lone = lone_variant(ROGUE, RUN, before, honest_round, 0, -before.aggregate, 0)
    return honest, lone


def test_the_lone_variant_is_a_complete_update_of_the_honest_round() -> None:
    honest, lone = _lone()
    assert lone.update_id == honest.update_id
    assert [h.author for h in lone.contributions] == [ROGUE.peer_id]
    in_group = member_check(RUN, lone.head.group_key)
    assert lone.problem(in_group) is None
    pipeline = _pipeline()
    assert pipeline.submit_group(lone, in_group).accepted
    assert torch.isfinite(pipeline.replica.params).all() and pipeline.replica.numel == NUMEL


def test_the_honest_round_prevails_over_the_lone_variant_and_refuses_it_after() -> None:
    honest, lone = _lone()
    a, b = GroupVariant.of(honest), GroupVariant.of(lone)
    assert prevailing(a, b) is a and prevailing(b, a) is a
    head = honest.head
    proof = GroupProof.of(RUN, head.group_key, head.round, a, b, THE_RUN)
    assert proof.superseded_key == b.key
    pipeline = _pipeline()
    in_group = member_check(RUN, head.group_key)
    assert pipeline.submit_group(lone, in_group).accepted
    assert pipeline.learn_group_proof(proof, lambda uid: lone) == "withdraw"
    refused = _pipeline()
    refused.learn_group_proof(proof, lambda uid: None)
    assert not refused.submit_group(lone, in_group).accepted
    assert refused.submit_group(honest, in_group).accepted


def test_an_honest_member_still_collecting_does_not_adopt_the_lone_variant() -> None:
    """An honest member's round of four (the rogue counted in its census) with two parts in:
    a group-done notice of the lone variant names another included set, so the member fetches
    it and `adopt`s it (dht.grouping_done `done_action`). The lone variant includes one
    member, below the round's quorum (two of four), which no honest completer reduces
    (`GroupReduction._start_reducing` abandons there); `adopt` checked only the id, the
    headers this member holds and the signatures, so the member's round ended with the rogue's
    update and its own part is carried. Fixed in session 24: `adopt` refuses an update below
    the round's quorum (this test failed before)."""
    _, lone = _lone()
    key = lone.head.group_key
    members = [m.peer_id for m in IDS[:3]] + [ROGUE.peer_id]
    reduction = GroupReduction(group_key=key, epoch=0, round=2, members=members)
    for i, member in enumerate(IDS[:2]):
        fields = RoundFields(
            run_id=RUN, group_key=key, epoch=0, round=2, learners=2, base_applied=2,
            published_applied=2,
        )  # fmt: skip
        tensor = torch.full((NUMEL,), 0.01 * (i + 1))
        reduction.contribute(ContributionHeader.of(tensor, member, fields, 500), tensor)
    assert len(lone.contributions) < reduction.quorum
    assert not reduction.adopt(lone)


def test_a_replica_that_forms_the_proof_from_the_prevailing_variant_passes_it_on() -> None:
    """bench.attack_group (rogue25, run 1): every honest member held its group's round when
    the rogue pushed its lone variant of the same id; each merge refused it as
    `group_equivocation` and made the proof (merge.pipeline `group_evidence`), but
    `EquivocationBook.learn` answers "none" for a superseding proof whose prevailing variant
    is applied here (nothing to change) and dht.gossip_evidence `_settle` returned on "none"
    before it passed the proof on: a replica that applied the lone variant first (a node done
    training, or another group's) never learnt it and kept the rogue's step until the
    parameter anti-entropy realigned it. The first learning now answers "keep" (passed on)."""
    honest, lone = _lone()
    in_group = member_check(RUN, honest.head.group_key)
    pipeline = _pipeline()
    assert pipeline.submit_group(honest, in_group).accepted
    assert pipeline.submit_group(lone, in_group).reason == "group_equivocation"
    proof = pipeline.group_evidence(lone)
    assert proof is not None and proof.superseded_key == GroupVariant.of(lone).key
    assert pipeline.learn_group_proof(proof, lambda uid: honest) == "keep"
    assert pipeline.learn_group_proof(proof, lambda uid: honest) == "none"  # once: no echo
