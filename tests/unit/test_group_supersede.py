"""Two complete variants of one group round of which one includes more members
(merge.group_equivocation `prevailing`, docs/scale.md Session 21): a member alone, or a retry
without a lost member, completes a lesser variant; it voids nothing on any replica, in any
order, and contributes nothing where the pair's proof has arrived; variants that include as
many still void the round (merge.equivocation's rule)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping_wire import decode_update, encode_update
from dht.retention import RetainedUpdates, serve_superseded
from merge.equivocation import EquivocationBook, UpdateId
from merge.group_equivocation import GroupProof, GroupVariant, prevailing
from merge.group_update import GroupUpdate, ReductionConfig
from merge.pipeline import MergeConfig, UpdatePipeline
from merge.shard_round import (
    AwaitedVariant,
    Incoming,
    ShardRound,
    part_gram,
    state_tensors,
    summed_gram,
)
from tests.factories import FINGERPRINT
from tests.unit.test_group_equivocation import (
    DELAYED,
    THE_RUN,
    UID,
    _apply,
    _pipeline,
    _retained,
)
from tests.unit.test_group_merge import CONFIG, IDS, NUMEL, RUN, _update

HONEST = _update(IDS[:3])
"""A round of a group of four, three included (the quorum is two)."""
LONE = _update([IDS[0]], scale=40.0)
"""The same round as its member IDS[0] completes it alone: itself included, its own list."""
RETRY_FIRST, RETRY_SECOND = _update(IDS[:4]), _update(IDS[:3])
"""An honest round completed with four, then again with three after a member died."""
PAIRS = {"lone": (HONEST, LONE), "retry": (RETRY_FIRST, RETRY_SECOND)}


def _proof(a: GroupUpdate, b: GroupUpdate) -> GroupProof:
    head = a.head
    return GroupProof.of(
        RUN, head.group_key, head.round, GroupVariant.of(a), GroupVariant.of(b), THE_RUN
    )


def test_the_variant_with_more_members_prevails_and_equal_ones_void() -> None:
    honest, lone = GroupVariant.of(HONEST), GroupVariant.of(LONE)
    assert len(lone.included) < ReductionConfig().quorum(4) <= len(honest.included)
    assert prevailing(honest, lone) is honest and prevailing(lone, honest) is honest
    proof = _proof(HONEST, LONE)
    assert proof.prevailing == honest and proof.superseded_key == lone.key
    other = GroupVariant.of(_update([IDS[1], IDS[2], IDS[3]], scale=3.0))
    assert prevailing(honest, other) is None  # three and three: equivocation
    assert _proof(HONEST, _update([IDS[1], IDS[2], IDS[3]], scale=3.0)).superseded_key is None


EVENTS = st.permutations(["kept", "lesser", "proof"]).flatmap(
    lambda order: st.lists(st.booleans(), min_size=3, max_size=3).map(
        lambda keep: [e for e, k in zip(order, keep, strict=True) if k or e == "proof"]
    )
)


def _alone(update: GroupUpdate | None, config: MergeConfig = DELAYED) -> UpdatePipeline:
    pipeline = _pipeline(config)
    if update is not None:
        assert _apply(pipeline, update)
    return pipeline


def _apply_parts(pipeline: UpdatePipeline, update: GroupUpdate) -> bool:
    """`update` merged by the sharded round (a round of one incoming update); a round that
    holds an awaited variant is fetched whole and merged one by one, as the wiring does."""
    rounds = ShardRound(pipeline.groups)
    in_group = THE_RUN.members_of(update.head.group_key)
    incoming = rounds.order([Incoming.of(pipeline.groups, update, in_group)])
    states = state_tensors(pipeline.replica)
    gram = summed_gram([part_gram([*states, update.aggregate])])
    try:
        plan = rounds.decide(incoming, gram)
    except AwaitedVariant:
        assert pipeline.equivocation.awaiting() == [UID]
        return _apply(pipeline, update)
    [result] = rounds.apply(plan, ShardRound.weighted_sums(plan, [update.aggregate]))
    return result.accepted


def _deliver(pipeline: UpdatePipeline, update: GroupUpdate, sharded: bool) -> bool:
    return _apply_parts(pipeline, update) if sharded else _apply(pipeline, update)


def _settle(pipeline: UpdatePipeline, kept: GroupUpdate, sharded: bool) -> None:
    """What the wiring does for an id whose prevailing variant a replica awaits: it fetches
    that variant again (dht.gossip_fetch `fetch_awaited`) and merges it."""
    for uid in pipeline.equivocation.awaiting():
        assert uid == UID
        assert _deliver(pipeline, kept, sharded)


def _replay(
    schedule: list[str], pair: str, sharded: bool, config: MergeConfig = DELAYED
) -> tuple[UpdatePipeline, GroupUpdate | None]:
    """A replica that hears `schedule` (each delivery on either path), then settles."""
    kept, lesser = PAIRS[pair]
    proof, pipeline, applied = _proof(kept, lesser), _pipeline(config), None
    for event in schedule:
        if event == "proof":
            pipeline.learn_group_proof(proof, _retained(applied))
            continue
        update = kept if event == "kept" else lesser
        if _deliver(pipeline, update, sharded) and applied is None:
            applied = update
    _settle(pipeline, kept, sharded)
    return pipeline, applied


@settings(max_examples=60, deadline=None)
@given(
    pair=st.sampled_from(sorted(PAIRS)),
    schedules=st.lists(EVENTS, min_size=3, max_size=3),
    paths=st.lists(st.booleans(), min_size=3, max_size=3),
    config=st.sampled_from([DELAYED, CONFIG]),
)
def test_every_replica_ends_with_the_prevailing_step_once_in_any_order(
    pair: str, schedules: list[list[str]], paths: list[bool], config: MergeConfig
) -> None:
    """Three replicas each hear the prevailing variant, the lesser one (or neither) and the
    pair's proof in their own order, each on the whole path or the sharded round; the wiring
    then delivers the prevailing variant to any that awaits it. None voids the round; every
    replica that heard the prevailing variant (or applied the lesser and was then served the
    prevailing one) ends with exactly its step, the params and the co-signer credit of a
    replica that applied it alone, and the same applied set; one that heard only the lesser
    ends unmoved by it; the proof told again, or either variant again, changes nothing."""
    kept, lesser = PAIRS[pair]
    proof = _proof(kept, lesser)
    with_kept, untouched = _alone(kept, config), _alone(None, config)
    for schedule, sharded in zip(schedules, paths, strict=True):
        pipeline, applied = _replay(schedule, pair, sharded, config)
        assert pipeline.learn_group_proof(proof, _retained(applied)) == "none"
        assert not pipeline.equivocation.is_equivocated(UID)
        assert not _deliver(pipeline, lesser, sharded)  # refused from the proof on
        assert pipeline.equivocation.awaiting() == []
        if "kept" in schedule or applied is lesser:
            torch.testing.assert_close(pipeline.replica.params, with_kept.replica.params)
            torch.testing.assert_close(
                pipeline.replica.outer.state_tensors(), with_kept.replica.outer.state_tensors()
            )
            assert pipeline.replica.cosigned.counts() == with_kept.replica.cosigned.counts()
            assert pipeline.replica.applied == with_kept.replica.applied
        else:
            torch.testing.assert_close(pipeline.replica.params, untouched.replica.params)
            torch.testing.assert_close(
                pipeline.replica.outer.state_tensors(), untouched.replica.outer.state_tensors()
            )
            assert pipeline.replica.cosigned.counts() == {}
            assert _apply(pipeline, kept)  # it takes the prevailing variant when it comes
        assert not _deliver(pipeline, kept, sharded)  # once: a duplicate now


def test_a_lesser_variant_is_refused_alike_by_the_sharded_round_after_the_proof() -> None:
    """Both paths refuse the lesser variant once the proof is known, and apply the
    prevailing one."""
    for update, accepted in ((LONE, False), (HONEST, True)):
        whole, parts = _pipeline(), _pipeline()
        for pipeline in (whole, parts):
            assert pipeline.learn_group_proof(_proof(HONEST, LONE), _retained(None)) == "keep"
        expected = whole.submit_group(update, THE_RUN.members_of(UID[0]))
        rounds = ShardRound(parts.groups)
        incoming = rounds.order([Incoming.of(parts.groups, update, THE_RUN.members_of(UID[0]))])
        states = state_tensors(parts.replica)
        plan = rounds.decide(incoming, summed_gram([part_gram([*states, update.aggregate])]))
        [result] = rounds.apply(plan, ShardRound.weighted_sums(plan, [update.aggregate]))
        assert (result.accepted, result.reason) == (expected.accepted, expected.reason)
        assert expected.accepted == accepted
        assert parts.replica.applied_digest() == whole.replica.applied_digest()


def test_a_superseding_proof_survives_a_checkpoint_and_a_voiding_one_replaces_it() -> None:
    donor = _pipeline()
    assert donor.learn_group_proof(_proof(HONEST, LONE), _retained(None)) == "keep"
    book = EquivocationBook(donor.equivocation.decode)
    book.load_state_dict(donor.equivocation.state_dict(), FINGERPRINT)
    assert not book.is_equivocated(UID)
    assert book.refuses(UID, GroupVariant.of(LONE).key)
    assert not book.refuses(UID, GroupVariant.of(HONEST).key)
    tie = _proof(HONEST, _update([IDS[1], IDS[2], IDS[3]], scale=3.0))
    assert book.learn(tie, applied=False) == "record"
    assert book.is_equivocated(UID) and book.refuses(UID, GroupVariant.of(HONEST).key)


def _awaiting() -> UpdatePipeline:
    """A replica that applied the lone variant, then learned the pair's proof."""
    pipeline = _pipeline()
    assert _apply(pipeline, LONE)
    assert pipeline.learn_group_proof(_proof(HONEST, LONE), _retained(LONE)) == "withdraw"
    assert pipeline.equivocation.awaiting() == [UID]
    return pipeline


def test_a_prevailing_variant_refused_before_the_proof_steps_when_the_proof_comes() -> None:
    """Lesser, prevailing, proof on the whole path: the prevailing variant, refused as a
    second variant, is held and steps in the lesser's slot as the proof withdraws it, with
    no fetch; a lesser variant that came second is not held."""
    pipeline = _pipeline()
    assert _apply(pipeline, LONE) and not _apply(pipeline, HONEST)
    assert pipeline.learn_group_proof(_proof(HONEST, LONE), _retained(LONE)) == "withdraw"
    assert pipeline.equivocation.awaiting() == [] and not pipeline.groups.pending
    torch.testing.assert_close(pipeline.replica.params, _alone(HONEST).replica.params)
    other = _pipeline()
    assert _apply(other, HONEST) and not _apply(other, LONE)
    assert not other.groups.pending  # fewer members than the applied one: nothing to hold


def test_the_awaited_step_survives_a_checkpoint_and_a_handover() -> None:
    """A replica that awaits the prevailing variant, restored from its checkpoint (the
    replica's, the pipeline's and the book's state, as node.persistence saves them) or
    handed over to a newcomer (transfer_state / adopt), steps it once when it comes, and
    ends as a replica that applied it alone; a book from before (no "awaiting") awaits
    nothing and refuses it as a duplicate, as before."""
    donor = _awaiting()
    restored = _pipeline()
    restored.replica.load_state_dict(donor.replica.state_dict())
    restored.load_state_dict(donor.state_dict())
    restored.equivocation.load_state_dict(donor.equivocation.state_dict(), FINGERPRINT)
    newcomer = _pipeline()
    newcomer.adopt(donor.transfer_state())
    alone = _alone(HONEST)
    for pipeline in (restored, newcomer):
        assert pipeline.equivocation.awaiting() == [UID]
        assert not _apply(pipeline, LONE) and _apply(pipeline, HONEST)
        assert not _apply(pipeline, HONEST)
        torch.testing.assert_close(pipeline.replica.params, alone.replica.params)
        assert pipeline.replica.applied == alone.replica.applied
    old = _pipeline()
    old.replica.load_state_dict(donor.replica.state_dict())
    state = donor.equivocation.state_dict()
    del state["awaiting"]
    old.equivocation.load_state_dict(state, FINGERPRINT)
    assert old.equivocation.awaiting() == [] and not _apply(old, HONEST)


def test_a_voiding_proof_after_the_prevailing_step_withdraws_it() -> None:
    """Equal counts void the round whatever came before: a replica that stepped the
    prevailing variant in the lesser's slot withdraws it like one that applied it first."""
    pipeline = _awaiting()
    assert _apply(pipeline, HONEST)
    tie = _proof(HONEST, _update([IDS[1], IDS[2], IDS[3]], scale=3.0))
    assert pipeline.learn_group_proof(tie, _retained(HONEST)) == "withdraw"
    assert pipeline.equivocation.is_equivocated(UID) and pipeline.equivocation.awaiting() == []
    untouched = _alone(None)
    torch.testing.assert_close(pipeline.replica.params, untouched.replica.params)


def test_the_copy_served_is_the_variant_applied_here() -> None:
    """The retained copy follows the merge (dht.retention `serve_superseded`): a replica that
    applied the lone variant and stepped the prevailing one in its place serves the
    prevailing one, and a later voiding proof finds the aggregate it applied there (before,
    the lone one's bytes stayed, and the voiding proof kept the step: "its applied aggregate
    is gone"); voided, nothing is served under the id."""
    pipeline, retained = _pipeline(), RetainedUpdates(per_author=4, budget_bytes=1 << 20)
    serve_superseded(pipeline, retained)

    def served(uid: UpdateId) -> GroupUpdate | None:
        data = retained.get(uid)
        return None if data is None else decode_update(data, NUMEL)

    assert _apply(pipeline, LONE)
    retained.put(UID, encode_update(LONE))  # as the wiring retains what it merged
    assert pipeline.learn_group_proof(_proof(HONEST, LONE), served) == "withdraw"
    assert UID not in retained  # the lesser is no longer served
    assert _apply(pipeline, HONEST)
    retained.put(UID, encode_update(HONEST))  # what fetch_awaited does after the merge
    assert retained.get(UID) == encode_update(HONEST)
    tie = _proof(HONEST, _update([IDS[1], IDS[2], IDS[3]], scale=3.0))
    assert pipeline.learn_group_proof(tie, served) == "withdraw"
    torch.testing.assert_close(pipeline.replica.params, _alone(None).replica.params)
    assert UID not in retained
