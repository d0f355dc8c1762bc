"""Vouchers for a state weigh by applied track record: fresh keys cannot outvote established
authors (bench.attack's Sybil vouchers made a newcomer load a poisoned state, 1.18x loss)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.heartbeat import Heartbeat
from dht.state_check import StateCheckError, applied_digest, check_donor_state, rank_donors
from dht.vouchers import heartbeat_records, state_records, weighted_lower_median
from tests.unit.test_state_check import PARAMS, SKETCH, donor_state, sketch_state

NOISE = torch.randn(1000, generator=torch.Generator().manual_seed(11))
POISONED = PARAMS + NOISE * float(PARAMS.norm()) / 1000**0.5
APPLIED = {"alice": list(range(1, 41)), "bob": list(range(1, 31))}
"""The honest applied set: alice's 40 updates and bob's 30."""


def established(peer_id: str, latest_seq: int, params: torch.Tensor = PARAMS) -> Heartbeat:
    """An honest author: the other honest peers report its updates applied. Its applied set
    differs a little from the donor's (a swarm still training): the vote on distance decides."""
    return Heartbeat(
        peer_id=peer_id, latest_seq=latest_seq, num_applied=70, sketch=SKETCH(params),
        applied_digest="cd" * 32, merged_by_author={"alice": 40, "bob": 30},
    )  # fmt: skip


def sybil(i: int, params: torch.Tensor = POISONED, **claims: object) -> Heartbeat:
    """A fresh key echoing the poisoned state's applied set and sketch."""
    fields: dict[str, object] = {
        "peer_id": f"sybil{i}", "num_applied": 70, "sketch": SKETCH(params),
        "applied_digest": applied_digest(APPLIED),
    } | claims  # fmt: skip
    return Heartbeat(**fields)  # type: ignore[arg-type]


HONEST = [established("alice", 40), established("bob", 30)]


@pytest.mark.parametrize("num_sybils", [1, 3, 10, 100])
def test_fresh_keys_vouching_for_a_poisoned_state_do_not_outvote_two_established_authors(
    num_sybils: int,
) -> None:
    peers = HONEST + [sybil(i) for i in range(num_sybils)]
    with pytest.raises(StateCheckError, match="track record"):
        check_donor_state(donor_state(POISONED, APPLIED), "mallory", peers, sketch_state)
    # and the same fresh keys, lying about the honest state, veto nothing
    liars = HONEST + [sybil(i) for i in range(num_sybils)]
    check_donor_state(donor_state(PARAMS, APPLIED), "donor", liars, sketch_state)


def test_with_no_track_record_in_the_swarm_keys_count_as_before() -> None:
    """What the weighting changes: without records (no merged_by_author reported), three
    echoing keys are the lower median and the poisoned state passes, as it did before."""
    anonymous = [
        Heartbeat(peer_id=h.peer_id, num_applied=70, sketch=h.sketch, applied_digest="cd" * 32)
        for h in HONEST
    ]
    peers = anonymous + [sybil(i) for i in range(3)]
    check_donor_state(donor_state(POISONED, APPLIED), "mallory", peers, sketch_state)


def test_a_clique_reporting_each_others_updates_gets_no_vote_in_a_state_without_them() -> None:
    clique = {f"sybil{i}": 1000 for i in range(20)}
    peers = HONEST + [sybil(i, latest_seq=1000, merged_by_author=clique) for i in range(20)]
    assert all(heartbeat_records(peers, "mallory")[f"sybil{i}"] == 1000 for i in range(20))
    assert set(state_records(APPLIED, peers, "mallory")) == {"alice", "bob"}
    with pytest.raises(StateCheckError):
        check_donor_state(donor_state(POISONED, APPLIED), "mallory", peers, sketch_state)


def test_a_state_holding_no_vouchers_updates_is_judged_by_heartbeat_records() -> None:
    """A donor serving an emptied applied set leaves no state record: established authors
    (by what their peers report) still judge it, fresh keys still do not."""
    peers = HONEST + [sybil(i) for i in range(10)]
    with pytest.raises(StateCheckError):
        check_donor_state(donor_state(POISONED, {}), "mallory", peers, sketch_state)


def test_the_donors_reports_earn_its_accomplices_no_vote_in_a_state_without_their_updates() -> None:
    donor_beat = Heartbeat(
        peer_id="mallory", num_applied=70, merged_by_author={f"sybil{i}": 50 for i in range(5)}
    )
    peers = [donor_beat, *HONEST] + [sybil(i, latest_seq=50) for i in range(5)]
    assert heartbeat_records(peers, "mallory")["sybil0"] == 50
    assert "sybil0" not in state_records(APPLIED, peers, "mallory")
    with pytest.raises(StateCheckError):
        check_donor_state(donor_state(POISONED, APPLIED), "mallory", peers, sketch_state)


def test_in_a_swarm_of_two_the_donors_report_gives_the_other_author_its_vote() -> None:
    """Alice serves; only alice reports bob's updates applied. Ten lying keys veto nothing."""
    alice, bob = HONEST
    bob_alone = Heartbeat(
        peer_id="bob", latest_seq=30, num_applied=70, sketch=SKETCH(PARAMS),
        applied_digest="cd" * 32, merged_by_author={},
    )  # fmt: skip
    peers = [alice, bob_alone] + [sybil(i) for i in range(10)]
    assert state_records(APPLIED, peers, "alice") == {"bob": 30}
    check_donor_state(donor_state(PARAMS, APPLIED), "alice", peers, sketch_state)


def test_a_record_is_capped_by_the_authors_own_signed_seq_and_by_the_state() -> None:
    boast = established("alice", 5)  # others say 40 applied; alice signed latest_seq 5
    assert heartbeat_records([boast, established("bob", 30)], "donor")["alice"] == 5
    records = state_records({"alice": [1, 2], "bob": [1, 99]}, HONEST, "donor")
    assert records == {"alice": 2, "bob": 1}  # bob's 99 lies beyond its announced seq + 1


@settings(max_examples=30, deadline=None)
@given(
    sybils=st.lists(
        st.tuples(st.booleans(), st.integers(0, 2000), st.booleans()), min_size=1, max_size=30
    ),
    poisoned=st.booleans(),
)
def test_no_crowd_of_fresh_keys_changes_the_verdict_of_established_authors(
    sybils: list[tuple[bool, int, bool]], poisoned: bool
) -> None:
    """Fresh keys (none of their updates in the state) with any sketch, any claimed seq, any
    reports of each other: the verdict is the one the established authors give alone."""
    clique = {f"sybil{i}": 1000 for i in range(len(sybils))}
    crowd = [
        sybil(
            i,
            POISONED if bad else PARAMS,
            latest_seq=seq,
            **({"merged_by_author": clique} if report else {}),
        )
        for i, (bad, seq, report) in enumerate(sybils)
    ]
    state = donor_state(POISONED if poisoned else PARAMS, APPLIED)
    assert (
        passes(state, "donor", HONEST + crowd) == passes(state, "donor", HONEST) == (not poisoned)
    )


def passes(state: dict[str, object], donor: str, peers: list[Heartbeat]) -> bool:
    """Whether `state` from `donor` passes the check against `peers`' heartbeats."""
    try:
        check_donor_state(state, donor, peers, sketch_state)
    except StateCheckError:
        return False
    return True


@given(st.lists(st.floats(0, 10), min_size=1, max_size=20))
def test_equal_weights_give_the_lower_median(values: list[float]) -> None:
    assert weighted_lower_median((v, 1) for v in values) == sorted(values)[(len(values) - 1) // 2]


def test_weights_count_and_zero_weights_do_not() -> None:
    assert weighted_lower_median([(0.0, 1), (0.0, 1), (1.0, 5)]) == 1.0
    assert weighted_lower_median([(0.0, 0), (1.0, 3)]) == 1.0
    assert weighted_lower_median([(0.0, 0)]) is None


def test_a_donor_echoed_by_established_authors_is_tried_before_one_echoed_by_fresh_keys() -> None:
    def claim(peer_id: str, num: int, digest: str, **extra: object) -> Heartbeat:
        return Heartbeat(
            peer_id=peer_id,
            num_applied=num,
            applied_digest=digest * 32,
            **extra,  # type: ignore[arg-type]
        )

    mallory = claim("mallory", 5000, "ee")
    crowd = [claim(f"sybil{i}", 5000, "ee", serves_state=False) for i in range(50)]
    honest_donor = claim("carol", 70, "aa")
    echo = claim(
        "alice", 70, "aa", latest_seq=40, serves_state=False,
        merged_by_author={"alice": 40, "bob": 30},
    )  # fmt: skip
    bob = claim("bob", 69, "bb", latest_seq=30, serves_state=False, merged_by_author={"alice": 40})
    ranked = rank_donors([mallory, *crowd, honest_donor, echo, bob], 0)
    assert [h.peer_id for h in ranked] == ["carol", "mallory"]
