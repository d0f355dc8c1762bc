"""The state check in a swarm of learner groups: members vouch by the group updates they
co-signed (the state's co-signer ledger, merge.cosign_ledger), not one vote per key.

With groups every applied update is authored by a group key, so no member had an author
record and the vote fell back to one per key: three fresh keys echoing a poisoned state
outvoted two honest members (the first test shows it without the ledger)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.heartbeat import Heartbeat
from dht.state_check import StateCheckError, applied_digest, check_donor_state
from dht.vouchers import state_records
from tests.unit.test_state_check import PARAMS, SKETCH, donor_state, sketch_state
from tests.unit.test_vouchers import POISONED, passes

KEY_A, KEY_B = "groups.0b0", "groups.0b1"
APPLIED = {KEY_A: list(range(1, 21)), KEY_B: list(range(1, 16))}
"""Two groups' applied updates: 20 of group 0's, 15 of group 1's."""
LEDGER = {"ann": {KEY_A: 20}, "amy": {KEY_A: 18}, "ben": {KEY_B: 15}}
"""Who co-signed them (amy was left out of two rounds)."""
REPORTED = {KEY_A: 20, KEY_B: 15}


def member(peer_id: str) -> Heartbeat:
    """An honest member: it reports both groups' updates applied and sketches the honest
    replica (its applied set a little behind the donor's: the vote on distance decides)."""
    return Heartbeat(
        peer_id=peer_id, num_applied=35, sketch=SKETCH(PARAMS), applied_digest="cd" * 32,
        merged_by_author=dict(REPORTED),
    )  # fmt: skip


def fresh(i: int, **claims: object) -> Heartbeat:
    fields: dict[str, object] = {
        "peer_id": f"sybil{i}", "num_applied": 35, "sketch": SKETCH(POISONED),
        "applied_digest": applied_digest(APPLIED),
    } | claims  # fmt: skip
    return Heartbeat(**fields)  # type: ignore[arg-type]


MEMBERS = [member("ann"), member("amy"), member("ben")]


def grouped_state(params: object, cosigned: object = LEDGER) -> dict[str, object]:
    return donor_state(params, APPLIED) | ({} if cosigned is None else {"cosigned": cosigned})  # type: ignore[arg-type]


def test_without_the_ledger_fresh_keys_outvote_members_and_with_it_they_do_not() -> None:
    peers = MEMBERS + [fresh(i) for i in range(5)]
    check_donor_state(grouped_state(POISONED, None), "mallory", peers, sketch_state)  # the gap
    with pytest.raises(StateCheckError, match="track record"):
        check_donor_state(grouped_state(POISONED), "mallory", peers, sketch_state)


def test_a_members_record_is_what_it_cosigned_capped_by_the_keys_reports() -> None:
    assert state_records(APPLIED, MEMBERS, "mallory", LEDGER) == {"ann": 20, "amy": 18, "ben": 15}
    low = [
        Heartbeat(peer_id=h.peer_id, merged_by_author={KEY_A: 5, KEY_B: 15}) for h in MEMBERS
    ]  # the others report only 5 of group 0's applied
    assert state_records(APPLIED, low, "mallory", LEDGER) == {"ann": 5, "amy": 5, "ben": 15}


def test_the_honest_state_passes_whatever_fresh_keys_say() -> None:
    peers = MEMBERS + [fresh(i, merged_by_author={KEY_A: 999}) for i in range(10)]
    check_donor_state(grouped_state(PARAMS), "donor", peers, sketch_state)


@pytest.mark.parametrize(
    "ledger",
    [
        {"ann": {KEY_A: 21}},  # beyond the key's 20 applied updates
        {"ann": {KEY_A: 0}},
        {"ann": {KEY_A: "20"}},
        {"ann": [KEY_A]},
        ["ann"],
    ],
)
def test_a_ledger_crediting_beyond_the_state_or_malformed_is_refused(ledger: object) -> None:
    with pytest.raises(StateCheckError, match="co-signer ledger"):
        check_donor_state(grouped_state(PARAMS, ledger), "donor", MEMBERS, sketch_state)


@settings(max_examples=30, deadline=None)
@given(
    crowd=st.lists(
        st.tuples(
            st.booleans(), st.dictionaries(st.sampled_from([KEY_A, KEY_B]), st.integers(0, 99))
        ),
        min_size=1,
        max_size=20,
    ),
    poisoned=st.booleans(),
)
def test_no_crowd_of_fresh_keys_changes_the_members_verdict(
    crowd: list[tuple[bool, dict[str, int]]], poisoned: bool
) -> None:
    """Fresh keys (co-signed nothing in the state) with any sketch and any reports of the group
    keys: the verdict is the one the co-signing members give alone."""
    state = grouped_state(POISONED if poisoned else PARAMS)
    keys = [
        fresh(i, sketch=SKETCH(POISONED if bad else PARAMS), merged_by_author=reports)
        for i, (bad, reports) in enumerate(crowd)
    ]
    verdict = passes(state, "mallory", MEMBERS + keys)
    assert verdict == passes(state, "mallory", MEMBERS) == (not poisoned)
