"""The proofs tests/unit/data/proofs_v1.json holds, built again from fixed keys and tensors
(tests/unit/test_proof_wire.py): one solo author's, one learner group's."""

from __future__ import annotations

import functools

from dht.grouping import member_check
from merge.equivocation import Proof
from merge.group_equivocation import GroupProof, GroupRun, GroupVariant
from tests.factories import identity, sealed_update
from tests.unit.test_group_merge import RUN, _update

GROUP_RUN = GroupRun(RUN, functools.partial(member_check, RUN))
MEMBERS = [identity(f"proof-wire-{i}") for i in range(3)]


def solo_proof() -> Proof:
    """Two payloads one author signed under one id."""
    a = sealed_update(MEMBERS[0], delta=[0.5, 0.0, -0.5, 1.0], seq=3, learners=4)
    b = sealed_update(MEMBERS[0], delta=[0.25, 0.5, 0.0, 0.5], seq=3, learners=4)
    return Proof.of(a.signed_header, b.signed_header)


def group_updates() -> tuple:
    """Two complete updates of one group round, included sets of two that share a member."""
    return _update(MEMBERS[:2]), _update([MEMBERS[0], MEMBERS[2]], scale=2.0)


def group_proof() -> GroupProof:
    """The proof the two `group_updates` make (their shard digests chunk roots: session 27)."""
    a, b = group_updates()
    variants = GroupVariant.of(a), GroupVariant.of(b)
    return GroupProof.of(RUN, a.head.group_key, a.head.round, *variants, GROUP_RUN)
