"""dht.realign with learner groups: the authors of applied updates are group keys, so a peer's
record is the group updates it co-signed (merge.cosign_ledger, dht.vouchers.group_record).

Before, no live peer had a record when every applied update was a group's, so there was no
donor and neither the settle nor the gap ran (bench.scale --sizes 16 --group-size 4
--scatter: one applied set of 48 on all 16, drift 0.0556 left)."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import group_key, member_check
from dht.heartbeat import Heartbeat
from dht.realign import Realign, RealignConfig, RealignPolicy, record_weights
from merge.cosign_ledger import parse_cosigned
from merge.envelope import UpdateHeader
from merge.outer import OuterConfig, make_outer_optimizer
from merge.replica import Replica
from tests.factories import FINGERPRINT
from tests.unit.test_group_merge import IDS, _pipeline, _update

PERIOD_S = 1.0
KEYS = [group_key(bits) for bits in ("0", "1")]
MEMBERS = {KEYS[0]: ["m0", "m1", "m2"], KEYS[1]: ["m3", "m4", "m5"]}


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def beat(
    name: str, sketch: list[float], reports: dict[str, int], *, latest_seq: int = 0
) -> Heartbeat:
    """`name`'s heartbeat at one applied set, reporting `reports` (group keys: how many of each
    it applied), with no update of its own (`latest_seq` 0: a group member publishes none)."""
    return Heartbeat(
        peer_id=name, applied_digest=_digest("held"), sketch=sketch, latest_seq=latest_seq,
        merged_by_author=reports, num_applied=sum(reports.values()),
    )  # fmt: skip


def cosigned_all(num: int) -> dict[str, dict[str, int]]:
    """Every member co-signed `num` applied updates of its group's key."""
    return {m: {key: num} for key, members in MEMBERS.items() for m in members}


# ---- the ledger: who co-signed what this replica applied --------------------------------------


def test_a_group_update_applied_credits_its_cosigners_and_the_credit_travels_with_the_state() -> (
    None
):
    update = _update(IDS[:3])
    pipeline = _pipeline()
    assert pipeline.submit_group(update, member_check("run-groups", update.head.group_key)).accepted
    cosigners = sorted(i.peer_id for i in IDS[:3])
    assert pipeline.replica.cosigned.counts() == {m: {update.head.group_key: 1} for m in cosigners}
    assert IDS[3].peer_id not in pipeline.replica.cosigned.counts()  # no part in it: no credit
    other = _pipeline()
    other.replica.load_state_dict(pipeline.replica.state_dict())
    assert other.replica.cosigned.counts() == pipeline.replica.cosigned.counts()
    older = pipeline.replica.state_dict()
    del older["cosigned"]  # a state from a node before this ledger: empty, not refused
    other.replica.load_state_dict(older)
    assert other.replica.cosigned.counts() == {}


@pytest.mark.parametrize(
    "cosigned",
    [
        {"m0": {KEYS[0]: 3}},  # more than the state applied of that key
        {"m0": {KEYS[1]: 1}},  # a key the state applied nothing of
        {"m0": {KEYS[0]: 0}},
        {"m0": {KEYS[0]: "1"}},
        {"m0": [KEYS[0]]},
        ["m0"],
    ],
)
def test_a_state_crediting_beyond_its_applied_set_is_refused(cosigned: object) -> None:
    with pytest.raises(ValueError, match="cosigned"):
        parse_cosigned(cosigned, {KEYS[0]: {1, 2}})


# ---- the records: co-signed, and reported by another live peer ------------------------------


def test_a_member_weighs_the_updates_it_cosigned_that_another_peer_reports_applied() -> None:
    reports = {KEYS[0]: 5, KEYS[1]: 4}
    beats = [beat(m, [1.0], reports) for m in ("m0", "m1", "m3")]
    cosigned = {"m0": {KEYS[0]: 5}, "m1": {KEYS[0]: 2}, "m3": {KEYS[1]: 4}, "m9": {KEYS[0]: 5}}
    assert record_weights(beats, reports, cosigned) == {"m0": 5, "m1": 2, "m3": 4}
    alone = [beat("m0", [1.0], reports)]  # nobody else reports the key: no evidence
    assert record_weights(alone, reports, cosigned) == {}
    fewer = [beat("m0", [1.0], reports), beat("m1", [1.0], {KEYS[0]: 3})]
    assert record_weights(fewer, reports, cosigned)["m0"] == 3  # as far as another applied
    assert record_weights(beats, reports) == {}  # without the ledger: session 14's swarm


KEY_OR_PEER = st.sampled_from([*KEYS, "m0", "m1", "m3", "s0", "s1"])


@settings(max_examples=80, deadline=None)
@given(
    num=st.integers(1, 30),
    sybils=st.lists(
        st.tuples(
            st.sampled_from(["s0", "s1", "s2", "s3"]),
            st.dictionaries(KEY_OR_PEER, st.integers(0, 10**6), max_size=6),
            st.integers(0, 10**6),
        ),
        max_size=6,
    ),
)
def test_a_sybil_clique_of_fresh_keys_weighs_nothing_and_moves_no_record(
    num: int, sybils: list[tuple[str, dict[str, int], int]]
) -> None:
    """Fresh keys that co-signed nothing applied here, whatever they report of each other and
    of the groups and whatever seq they claim, weigh nothing, and the members' weights are
    what they are without them."""
    reports = dict.fromkeys(KEYS, num)
    honest = [beat(m, [1.0], reports) for members in MEMBERS.values() for m in members]
    fake = [beat(name, [1.0], said, latest_seq=seq) for name, said, seq in sybils]
    weights = []
    for peers in (honest[1:], honest[1:] + fake):
        p = RealignPolicy(RealignConfig(period_s=PERIOD_S), "m0")
        p.observe(honest[0], peers, 0.0, cosigned_all(num))
        weights.append(dict(p._weights))
    assert weights[0] == weights[1] == {m: num for m in cosigned_all(num)}


UPDATES = st.lists(
    st.tuples(
        st.sampled_from(KEYS), st.sets(st.sampled_from(["m0", "m1", "m2", "m3"]), min_size=1)
    ),
    min_size=1,
    max_size=24,
)


def _replica() -> Replica:
    return Replica(torch.zeros(4), make_outer_optimizer(OuterConfig(kind="nesterov", lr=1.0), 4))


def _header(key: str, seq: int) -> UpdateHeader:
    return UpdateHeader(
        fingerprint=FINGERPRINT, author=key, seq=seq, base_applied=0, published_applied=0,
        inner_steps=1, tokens=1, loss=0.0, payload_sha256="0" * 64, codec="fp32", numel=4,
        created_at=0.0, learners=1,
    )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(updates=UPDATES, seed=st.integers(0, 2**16), cut=st.integers(0, 24))
def test_crediting_is_identical_on_every_replica_with_one_applied_set(
    updates: list[tuple[str, set[str]]], seed: int, cut: int
) -> None:
    """Two replicas apply one set of group updates in different orders, the second taking the
    first part through a donor's state (a newcomer, a realignment) and the rest itself: their
    ledgers agree, and so do the weights they give the same heartbeats, read in any order."""
    ids = [(key, seq, cosigners) for seq, (key, cosigners) in enumerate(updates, start=1)]
    shuffled = random.Random(seed).sample(ids, len(ids))
    first, donor, newcomer = _replica(), _replica(), _replica()
    for key, seq, cosigners in ids:
        first.apply(_header(key, seq), torch.zeros(4), 0.0, cosigners=sorted(cosigners))
    for key, seq, cosigners in shuffled[:cut]:
        donor.apply(_header(key, seq), torch.zeros(4), 0.0, cosigners=sorted(cosigners))
    newcomer.load_state_dict(donor.state_dict())
    for key, seq, cosigners in shuffled[cut:]:
        newcomer.apply(_header(key, seq), torch.zeros(4), 0.0, cosigners=sorted(cosigners))
    assert newcomer.applied_digest() == first.applied_digest()
    assert newcomer.cosigned.counts() == first.cosigned.counts()
    counts = {key: len(seqs) for key, seqs in first.applied.items()}
    beats = [beat(m, [1.0], counts) for m in ("m0", "m1", "m2", "m3")]
    ours = record_weights(beats, counts, first.cosigned.counts())
    theirs = record_weights(beats[::-1], counts, newcomer.cosigned.counts())
    assert ours == theirs
    assert set(ours) <= set().union(*(c for _, c in updates))  # only co-signers weigh


# ---- the settle with groups ---------------------------------------------------------------------


def test_a_group_swarm_held_at_one_applied_set_settles_to_one_donor() -> None:
    """Six members of two groups at one applied set of group updates, one replica 0.05 apart
        and one 0.001 apart: every replica picks one donor, and the two apart realign to its point
    (the donor's state, or a replica's already there)."""
    base = [float(i % 7) - 3.0 for i in range(32)]
    shifts = {"m0": 0.0, "m1": 0.0, "m2": 0.05, "m3": 0.0, "m4": 0.001, "m5": 0.0}
    reports = dict.fromkeys(KEYS, 12)
    beats = [beat(m, [v * (1 + s) for v in base], reports) for m, s in shifts.items()]
    policies = {m: RealignPolicy(RealignConfig(period_s=PERIOD_S), m) for m in shifts}
    decisions: dict[str, Realign | None] = {}
    for t in range(8):
        for name, p in policies.items():
            own = next(h for h in beats if h.peer_id == name)
            p.observe(own, [h for h in beats if h.peer_id != name], float(t), cosigned_all(12))
            decisions[name] = decisions.get(name) or p.decide(float(t))
    assert {p.settle_donor() for p in policies.values()} == {"m0"}
    assert {n for n, d in decisions.items() if d is not None} == {"m2", "m4"}
    at_donor = {m for m, s in shifts.items() if s == 0.0}  # the donor's point: the same state
    assert all(d.donor in at_donor for d in decisions.values() if d is not None)
    without = RealignPolicy(RealignConfig(period_s=PERIOD_S), "m2")  # session 14: no records
    for t in range(8):
        without.observe(beats[2], beats[:2] + beats[3:], float(t))
        assert without.decide(float(t)) is None
