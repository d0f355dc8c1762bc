"""A newcomer takes over its donor's merge state with the replica, and decides as the donor does.

Before, a state transfer carried the replica alone: the newcomer judged the next updates with
empty robust windows and an empty learner floor, and clipped or sized some of them unlike its
donor (bench.scale, N = 8: about one update id per run with different robust verdicts).
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.tensor_stream import join_tensors, split_tensors
from merge.equivocation import Proof
from merge.handover import HandoverError, check_handover
from merge.pipeline import MergeResult, UpdatePipeline
from tests.factories import identity
from tests.unit.test_merge_pipeline import ALICE, BOB, DELTA, make_pipeline, make_update

CAROL = identity("c")
AUTHORS = [ALICE, BOB, CAROL]


def over_the_wire(state: dict[str, Any]) -> dict[str, Any]:
    """`state` as dht.state_transfer sends it: a JSON tree and the tensors beside it."""
    tree, tensors = split_tensors(state)
    joined = join_tensors(json.loads(json.dumps(tree)), [t.clone() for t in tensors])
    assert isinstance(joined, dict)
    return joined


class Author:
    def __init__(self) -> None:
        self.seqs = {a.peer_id: 0 for a in AUTHORS}

    def update(self, who: int, scale: float, learners: int) -> Any:
        identity = AUTHORS[who]
        seq = self.seqs[identity.peer_id]
        self.seqs[identity.peer_id] += 1
        return make_update(identity, [scale * d for d in DELTA], seq=seq, learners=learners)


def decisions(result: MergeResult) -> tuple[object, ...]:
    return (result.accepted, result.reason, result.robust, result.learners, result.weight)


def test_a_newcomer_clips_the_outlier_its_donor_clips() -> None:
    authors, donor = Author(), make_pipeline()
    for i in range(6):
        assert donor.submit(authors.update(i % 2, 0.1, learners=2)).accepted
    outlier = authors.update(0, 1.0, learners=1)  # 10x the window's norms, and a low claim
    newcomer, replica_only = make_pipeline(), make_pipeline()
    newcomer.adopt(over_the_wire(donor.transfer_state()))
    replica_only.replica.load_state_dict(over_the_wire(donor.replica.state_dict()))

    results = [p.submit(outlier) for p in (donor, newcomer, replica_only)]

    assert results[0].robust == "norm_outlier" and results[0].learners == 2
    assert decisions(results[1]) == decisions(results[0])
    assert torch.equal(newcomer.replica.params, donor.replica.params)
    # What the replica alone decided (the state transfer before): a whole outer step, unclipped.
    assert results[2].robust is None and results[2].learners == 1
    assert not torch.equal(replica_only.replica.params, donor.replica.params)


update = st.tuples(st.integers(0, 2), st.floats(0.02, 0.9), st.integers(1, 4))


@settings(max_examples=60, deadline=None)
@given(before=st.lists(update, max_size=40), after=st.lists(update, min_size=1, max_size=20))
def test_a_newcomer_decides_every_later_update_as_its_donor(
    before: list[tuple[int, float, int]], after: list[tuple[int, float, int]]
) -> None:
    authors, donor = Author(), make_pipeline()
    for who, scale, learners in before:
        donor.submit(authors.update(who, scale, learners))
    newcomer = make_pipeline()
    newcomer.adopt(over_the_wire(donor.transfer_state()))
    assert newcomer.state_dict() == donor.state_dict()
    for who, scale, learners in after:
        signed = authors.update(who, scale, learners)
        assert decisions(newcomer.submit(signed)) == decisions(donor.submit(signed))
    assert torch.equal(newcomer.replica.params, donor.replica.params)
    assert newcomer.replica.applied_digest() == donor.replica.applied_digest()


def test_proofs_of_equivocation_come_along_and_settle_what_the_donor_applied() -> None:
    donor = make_pipeline()
    a = make_update(ALICE, DELTA, seq=3, learners=2)
    b = make_update(ALICE, [0.25, 0.5, 0.0, 0.5], seq=3, learners=2)
    c = make_update(BOB, DELTA, seq=0, learners=2)
    d = make_update(BOB, [0.25, 0.5, 0.0, 0.5], seq=0, learners=2)
    assert donor.submit(a).accepted
    assert donor.learn_proof(Proof.of(a.signed_header, b.signed_header), lambda h: a) == "withdraw"
    state = over_the_wire(donor.transfer_state())
    bob_proof = Proof.of(c.signed_header, d.signed_header)
    # A proof the donor holds for an id it never applied cannot be claimed settled.
    state["equivocation"]["proofs"].append(bob_proof.to_bytes().hex())
    state["equivocation"]["settled"].append([BOB.peer_id, 0])
    state["equivocation"]["proofs"].append("not hex")
    newcomer = make_pipeline()

    newcomer.adopt(state)

    assert newcomer.equivocation.is_equivocated((ALICE.peer_id, 3))
    assert newcomer.learn_proof(Proof.of(a.signed_header, b.signed_header), lambda h: a) == "none"
    assert newcomer.learn_proof(bob_proof, lambda h: None) == "record"
    assert len(newcomer.equivocation) == 2


def test_a_permissioned_newcomer_takes_no_proof_of_a_key_off_its_list() -> None:
    """A donor's state is untrusted: in a permissioned run a proof whose signer is off the
    list is dropped (its updates are refused there anyway), the listed author's kept."""
    donor = make_pipeline()
    a = make_update(ALICE, DELTA, seq=3, learners=2)
    b = make_update(ALICE, [0.25, 0.5, 0.0, 0.5], seq=3, learners=2)
    c = make_update(CAROL, DELTA, seq=0, learners=2)
    d = make_update(CAROL, [0.25, 0.5, 0.0, 0.5], seq=0, learners=2)
    for proof in (
        Proof.of(a.signed_header, b.signed_header),
        Proof.of(c.signed_header, d.signed_header),
    ):
        assert donor.learn_proof(proof, lambda h: None) == "record"
    listed = {ALICE.peer_id, BOB.peer_id}
    permissioned, open_run = make_pipeline(), make_pipeline()
    permissioned.admit = listed.__contains__

    for newcomer in (permissioned, open_run):
        newcomer.adopt(over_the_wire(donor.transfer_state()))

    assert len(open_run.equivocation) == 2 and len(permissioned.equivocation) == 1
    assert permissioned.equivocation.is_equivocated((ALICE.peer_id, 3))
    assert not permissioned.equivocation.is_equivocated((CAROL.peer_id, 0))


def test_a_donor_of_an_earlier_version_hands_over_its_replica_alone() -> None:
    donor, newcomer = make_pipeline(), make_pipeline()
    for seq in range(5):
        assert newcomer.submit(make_update(CAROL, [0.1 * d for d in DELTA], seq=seq)).accepted
        assert donor.submit(make_update(BOB, DELTA, seq=seq, learners=2)).accepted
    kept = newcomer.state_dict()

    newcomer.adopt(over_the_wire(donor.replica.state_dict()))

    assert torch.equal(newcomer.replica.params, donor.replica.params)
    assert newcomer.state_dict() == kept


def refused(state: dict[str, Any], change: str) -> dict[str, Any]:
    merge = state["merge"]
    floor, norms = merge["learner_floor"]["recent"], merge["robust"][0]["norms"]
    if change == "unknown_author":
        floor[0][0] = CAROL.peer_id
    elif change == "more_than_applied":
        floor.append(list(floor[0]))
    elif change == "window_too_long":
        floor.extend([list(floor[0])] * 300)
    elif change == "norm_above_cap":
        norms[0] = 100.0
    elif change == "norm_negative":
        norms[0] = -0.5
    elif change == "norm_nan":
        norms[0] = math.nan
    elif change == "claim_zero":
        floor[0][1] = 0
    elif change == "robust_missing":
        merge["robust"] = []
    elif change == "not_a_mapping":
        state["merge"] = [1, 2]
    elif change == "robust_author_unknown":
        merge["robust"][0]["authors"][0] = CAROL.peer_id
    elif change == "ledger_unknown_author":
        merge["ledger"]["accounts"][0][0] = CAROL.peer_id
    elif change == "ledger_record_above_applied":
        merge["ledger"]["accounts"][0][4] = 6.0  # alice applied 5 updates
    elif change == "ledger_total_above_applied":
        merge["ledger"]["total"] = 6.0
    return state


@pytest.mark.parametrize(
    "change",
    [
        "unknown_author",
        "more_than_applied",
        "window_too_long",
        "norm_above_cap",
        "norm_negative",
        "norm_nan",
        "claim_zero",
        "robust_missing",
        "not_a_mapping",
        "robust_author_unknown",
        "ledger_unknown_author",
        "ledger_record_above_applied",
        "ledger_total_above_applied",
    ],
)
def test_a_merge_state_its_replica_does_not_allow_is_refused_and_changes_nothing(
    change: str,
) -> None:
    donor, newcomer = make_pipeline(), make_pipeline()
    for seq in range(5):
        assert donor.submit(make_update(ALICE, DELTA, seq=seq, learners=2)).accepted
        assert newcomer.submit(make_update(BOB, DELTA, seq=seq)).accepted
    before = (newcomer.replica.state_dict(), newcomer.state_dict())

    with pytest.raises(ValueError):
        newcomer.adopt(refused(over_the_wire(donor.transfer_state()), change))

    after = (newcomer.replica.state_dict(), newcomer.state_dict())
    assert torch.equal(after[0]["params"], before[0]["params"])  # type: ignore[arg-type]
    assert after[0]["applied"] == before[0]["applied"] and after[1] == before[1]


def test_the_checks_know_nothing_of_the_formats_loaders_check() -> None:
    applied = {"alice": {0, 1}}
    check_handover(
        {"learner_floor": {"recent": [["alice", 2]]}, "robust": [{"norms": [0.5]}]},
        applied,
        norm_cap=1.0,
        window=4,
    )
    with pytest.raises(HandoverError, match="never applied"):
        check_handover(
            {"learner_floor": {"recent": [["bob", 2]]}, "robust": []},
            applied,
            norm_cap=1.0,
            window=4,
        )


json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    part=st.sampled_from(["merge", "learner_floor", "robust", "recent", "equivocation", "ledger"]),
    value=json_value,
)
def test_arbitrary_merge_states_raise_only_validation_errors(part: str, value: object) -> None:
    donor = make_pipeline()
    for seq in range(3):
        donor.submit(make_update(ALICE, DELTA, seq=seq, learners=2))
    state = over_the_wire(donor.transfer_state())
    if part in ("merge", "equivocation"):
        state[part] = value
    elif part == "recent":
        state["merge"]["learner_floor"]["recent"] = value
    else:
        state["merge"][part] = value
    newcomer: UpdatePipeline = make_pipeline()
    try:
        newcomer.adopt(state)
    except ValueError:
        assert newcomer.replica.num_applied == 0
