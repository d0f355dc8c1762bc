"""A permissioned run's list holds on the group path too (merge.group_pipeline, docs/trust.md):
a group update or a proof of a group's equivocation signed by any key off `--allow-keys` is
refused and counted, so keys ground into a group's prefix neither join a variant nor make one
prevail over the listed members' round. Before session 24 the group path never asked the
list: a variant of ground keys was applied, and their proof withdrew the honest round."""

from __future__ import annotations

import pytest
import torch

from dht.grouping import member_check
from merge.identity import Identity
from merge.pipeline import UpdatePipeline
from tests.unit.test_group_equivocation import RUN, _pipeline
from tests.unit.test_group_merge import IDS, _update
from tests.unit.test_group_supersede import _apply_parts, _proof

LISTED = IDS[:3]
GROUND = [Identity.generate() for _ in range(4)]
"""Keys a Sybil ground into the group's prefix (the root group: every key is in it)."""
HONEST = _update(LISTED)
"""The listed members' round: three included."""
GRINDER = _update([LISTED[0], *GROUND], scale=30.0)
"""The same round as one listed member completes it with four ground keys: five included,
more than the honest three, so it prevails where the list is not asked (an open run)."""


def _permissioned() -> UpdatePipeline:
    pipeline = _pipeline()
    allowed = {m.peer_id for m in LISTED}
    pipeline.admit = allowed.__contains__
    return pipeline


def _submit(pipeline: UpdatePipeline, update: object) -> tuple[bool, str | None]:
    result = pipeline.submit_group(update, member_check(RUN, HONEST.head.group_key))  # type: ignore[arg-type]
    return result.accepted, result.reason


@pytest.mark.parametrize("first", ["honest", "grinder"])
def test_a_variant_signed_by_a_key_off_the_list_is_refused_and_counted(first: str) -> None:
    pipeline = _permissioned()
    before = pipeline.replica.params.clone()
    if first == "grinder":
        assert _submit(pipeline, GRINDER) == (False, "group_not_allowed")
        assert torch.equal(pipeline.replica.params, before)  # nothing of it stepped
    assert _submit(pipeline, HONEST) == (True, None)
    after = pipeline.replica.params.clone()
    if first == "honest":
        assert _submit(pipeline, GRINDER) == (False, "group_not_allowed")  # not a pair held
    assert pipeline.rejections["group_not_allowed"] == 1
    assert torch.equal(pipeline.replica.params, after)
    assert pipeline.groups.pending == {}


def test_a_proof_pairing_the_listed_round_with_ground_keys_settles_nothing() -> None:
    """The proof of the honest round and the grinder's variant checks out (every signature
    holds, every key is in the prefix); a permissioned replica neither withdraws the honest
    round for it nor passes it on ("none"), and counts it. An open run withdraws it (the
    gap docs/trust.md leaves open: k ground keys prevail over fewer honest members)."""
    proof = _proof(HONEST, GRINDER)
    assert proof.prevailing.included == tuple(h.author for h in GRINDER.contributions)
    steps = {}
    for name, pipeline in (("permissioned", _permissioned()), ("open", _pipeline())):
        assert _submit(pipeline, HONEST) == (True, None)
        action = pipeline.learn_group_proof(proof, lambda uid: HONEST)
        steps[name] = (action, pipeline.groups.variants.key_of(proof.update_id))
    assert steps["permissioned"][0] == "none"
    assert steps["permissioned"][1] is not None  # the honest round still holds its id
    assert steps["open"][0] == "withdraw"
    pipeline = _permissioned()
    pipeline.learn_group_proof(proof, lambda uid: None)
    assert pipeline.rejections["group_not_allowed"] == 1
    assert pipeline.equivocation.proofs() == []  # not kept, so not checkpointed either


def test_listed_members_still_settle_their_own_equivocation() -> None:
    """Two variants of listed members only (three and three: void) are settled as before."""
    other = _update(IDS[:2] + [IDS[3]], scale=3.0)
    pipeline = _permissioned()
    pipeline.admit = {m.peer_id for m in IDS[:4]}.__contains__
    assert _submit(pipeline, HONEST) == (True, None)
    assert pipeline.learn_group_proof(_proof(HONEST, other), lambda uid: HONEST) == "withdraw"


def test_the_sharded_round_refuses_a_variant_off_the_list_alike() -> None:
    """The sharded round decides from the same problem (merge.shard_round_plan asks
    `GroupMerge._problem`): the grinder's variant is refused there too, counted, and the
    listed round applied, so replicas on the two paths hold one applied set."""
    pipeline = _permissioned()
    assert not _apply_parts(pipeline, GRINDER)
    assert pipeline.rejections["group_not_allowed"] == 1
    assert _apply_parts(pipeline, HONEST)
    whole = _permissioned()
    assert _submit(whole, GRINDER) == (False, "group_not_allowed")
    assert _submit(whole, HONEST) == (True, None)
    assert pipeline.replica.applied == whole.replica.applied
