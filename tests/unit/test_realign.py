"""Parameter anti-entropy (dht.realign): which replica realigns, to whom, and how often.

A swarm is simulated by heartbeats: each honest node's settled sketch at an applied digest is
a common point plus its own lineage's offset (0.13 of the norm: the start-up floor's one
step sized by another learner count; ~0.004: honest noise). What the donor lacked, merged
again after the adopt: test_realign_adopt.py; the settle at a held digest:
test_realign_settle.py (its helpers are these)."""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.heartbeat import Heartbeat
from dht.realign import (
    Realign,
    RealignConfig,
    RealignPolicy,
    choose_donor,
    record_weights,
)

PERIOD_S = 1.0
DIMS = 32


def digest(i: int) -> str:
    return hashlib.sha256(f"applied set {i}".encode()).hexdigest()


def point(i: int) -> list[float]:
    """The settled point every honest replica reaches at digest i (norm ~ sqrt(DIMS))."""
    rng = random.Random(i)
    return [rng.gauss(0, 1) for _ in range(DIMS)]


def offset(name: str, size: float) -> list[float]:
    """A lineage's offset, `size` relative to the points' norm."""
    rng = random.Random(name)
    raw = [rng.gauss(0, 1) for _ in range(DIMS)]
    norm = sum(v * v for v in raw) ** 0.5
    return [v / norm * size * DIMS**0.5 for v in raw]


def heartbeat(
    name: str,
    at_digest: int,
    lineage: float,
    *,
    records: dict[str, int] | None = None,
    latest_seq: int = 10,
    num_realigned: int = 0,
    serves_state: bool = True,
) -> Heartbeat:
    """`name`'s heartbeat at digest `at_digest`, its lineage `lineage` off the common point;
    it reports `records` (author -> updates applied) as its applied set's counts."""
    shift = offset(name, lineage)
    sketch = [round(p + s, 7) for p, s in zip(point(at_digest), shift, strict=True)]
    return Heartbeat(
        peer_id=name, applied_digest=digest(at_digest), sketch=sketch, latest_seq=latest_seq,
        merged_by_author=records or {}, num_applied=sum((records or {}).values()),
        num_realigned=num_realigned, serves_state=serves_state,
    )  # fmt: skip


def swarm(lineages: dict[str, float], at_digest: int, **kw: object) -> list[Heartbeat]:
    """Every node at one digest, each reporting 10 updates of every node applied."""
    records = dict.fromkeys(lineages, 10)
    return [heartbeat(n, at_digest, off, records=records, **kw) for n, off in lineages.items()]  # type: ignore[arg-type]


def policy(name: str, **config: object) -> RealignPolicy:
    return RealignPolicy(RealignConfig(period_s=PERIOD_S, **config), name)  # type: ignore[arg-type]


def feed(p: RealignPolicy, heartbeats: list[Heartbeat], now: float) -> None:
    own = next(h for h in heartbeats if h.peer_id == p.self_id)
    p.observe(own, [h for h in heartbeats if h.peer_id != p.self_id], now)


THREE = {"node0": 0.0, "node1": 0.003, "node2": 0.13}
"""node2 sized one update by another learner count (the defect test_swarm saw)."""


def run(lineages: dict[str, float], names: list[str], digests: int = 2, step_s: float = 1.0):
    """Each of `names`' policies fed the swarm at `digests` successive digests, `step_s`
    apart; their decisions at the end."""
    policies = {n: policy(n) for n in names}
    for i in range(digests):
        for p in policies.values():
            feed(p, swarm(lineages, i), now=i * step_s)
    return {n: p.decide(now=digests * step_s) for n, p in policies.items()}, policies


def test_the_replica_that_drifted_from_two_agreeing_peers_realigns_to_the_smaller_id() -> None:
    decisions, policies = run(THREE, list(THREE))
    assert {p.donor() for p in policies.values()} == {"node0"}
    assert decisions["node0"] is None and decisions["node1"] is None
    realign = decisions["node2"]
    assert isinstance(realign, Realign) and realign.donor == "node0"
    assert realign.distance == pytest.approx(0.13, abs=0.03)


def test_honest_noise_never_makes_a_replica_realign() -> None:
    decisions, _ = run({"node0": 0.0, "node1": 0.004, "node2": 0.008}, ["node0", "node1", "node2"])
    assert set(decisions.values()) == {None}


def test_one_sighting_or_two_within_a_period_are_not_enough() -> None:
    decisions, _ = run(THREE, ["node2"], digests=1)
    assert decisions["node2"] is None
    decisions, _ = run(THREE, ["node2"], digests=2, step_s=0.4)
    assert decisions["node2"] is None
    # the drift must hold at the latest shared digest too: it healed, no realignment
    p = policy("node2")
    feed(p, swarm(THREE, 0), 0.0)
    feed(p, swarm(THREE, 1), 1.0)
    feed(p, swarm({**THREE, "node2": 0.0}, 2), 2.0)
    assert p.decide(3.0) is None


def test_the_cooldown_and_the_cap_hold_whatever_the_heartbeats_say() -> None:
    p = policy("node2", cooldown_s=10.0, max_attempts=2, attempts_window_s=50.0)
    now = 0.0
    attempts = []
    for i in range(40):  # 40 s of a drift that never heals (every attempt refused)
        feed(p, swarm(THREE, i), now)
        if p.decide(now) is not None:
            attempts.append(now)
            p.started(now)
            p.finished(loaded=False)
        now += 1.0
    assert attempts == [1.0, 11.0]  # then the cap: two per 50 s
    assert p.num_refused == 2
    for i in range(40, 60):
        feed(p, swarm(THREE, i), float(i))
        if p.decide(float(i)) is not None:
            attempts.append(float(i))
            p.started(float(i))
    assert attempts[2:] == [51.0]  # the first attempt left the window


def test_after_loading_a_state_the_old_sightings_of_this_replica_are_forgotten() -> None:
    _, policies = run(THREE, ["node2"])
    p = policies["node2"]
    p.started(2.0)
    p.finished(loaded=True)
    assert p.num_realigned == 1
    # its next heartbeat carries the count: node2's old lineage is gone from every view
    healed = {**THREE, "node2": 0.001}
    feed(p, swarm(healed, 5, num_realigned=1), 70.0)
    feed(p, swarm(healed, 6, num_realigned=1), 71.0)
    assert p.decide(72.0) is None


def test_peers_forget_a_lineage_that_realigned() -> None:
    p = policy("node0")
    feed(p, swarm(THREE, 0), 0.0)
    feed(p, swarm(THREE, 1), 1.0)
    seen_before = p.donor()
    after = swarm({**THREE, "node2": 0.001}, 2, num_realigned=0)
    after[2] = heartbeat("node2", 2, 0.001, records=dict.fromkeys(THREE, 10), num_realigned=1)
    feed(p, after, 2.0)
    assert seen_before == p.donor() == "node0"
    assert [s.digest for s in p._participants["node2"].sightings] == [digest(2)]


def test_a_fresh_key_is_never_a_donor_nor_a_supporter() -> None:
    """mallory (no update of hers applied anywhere) reports node2's sketch at every digest,
    and an honest node's applied set never holds her updates: she weighs nothing."""
    p = policy("node0")
    for i in range(3):
        beats = swarm(THREE, i)
        beats.append(heartbeat("mallory", i, 0.13 + 1e-4, latest_seq=500))
        # a second fresh key vouches for mallory's 500 updates: still none applied here
        beats.append(heartbeat("sybil", i, 0.13, records={"mallory": 500}, latest_seq=500))
        feed(p, beats, float(i))
    assert p.donor() == "node0"
    assert "mallory" not in p._weights and "sybil" not in p._weights


def test_record_weights_are_capped_by_what_this_replica_applied() -> None:
    beats = [
        heartbeat("a", 0, 0.0, records={"b": 7}, latest_seq=9),
        heartbeat("b", 0, 0.0, records={"a": 9, "c": 50}, latest_seq=7),
        heartbeat("c", 0, 0.0, records={}, latest_seq=50),
    ]
    assert record_weights(beats, {"a": 9, "b": 3}) == {"a": 9, "b": 3}


def test_a_donor_that_does_not_serve_state_is_not_chosen() -> None:
    p = policy("node2")
    for i in range(2):
        beats = swarm(THREE, i)
        beats[0] = heartbeat("node0", i, 0.0, records=dict.fromkeys(THREE, 10), serves_state=False)
        feed(p, beats, float(i))
    decision = p.decide(2.0)
    assert decision is not None and decision.donor == "node1"


def test_two_replicas_far_apart_and_alone_agree_on_one_donor() -> None:
    decisions, policies = run({"a": 0.0, "b": 0.2}, ["a", "b"])
    assert {p.donor() for p in policies.values()} == {"a"}
    assert decisions["a"] is None and decisions["b"] == Realign("a", decisions["b"].distance)  # type: ignore[union-attr]


def test_choose_donor_with_nobody_eligible_is_none() -> None:
    assert choose_donor({}, {}, [], 0.02) is None


@settings(max_examples=40, deadline=None)
@given(
    lineages=st.lists(
        st.sampled_from([0.0, 0.003, 0.004, 0.05, 0.13, 0.3]), min_size=2, max_size=6
    ),
    counts=st.lists(st.integers(1, 40), min_size=6, max_size=6),
    num_digests=st.integers(2, 4),
    hostile=st.floats(0.0, 1.0),
)
def test_every_node_given_the_same_heartbeats_picks_the_same_donor_which_never_realigns(
    lineages: list[float], counts: list[int], num_digests: int, hostile: float
) -> None:
    names = [f"node{i}" for i in range(len(lineages))]
    records = {n: counts[i] for i, n in enumerate(names)}
    policies = {n: policy(n) for n in names}
    for i in range(num_digests):
        beats = [
            heartbeat(n, i, lineages[k], records=records, latest_seq=40)
            for k, n in enumerate(names)
        ]
        beats.append(heartbeat("fresh", i, hostile, records=records, latest_seq=40))
        for p in policies.values():
            feed(p, beats, float(i))
    donors = {p.donor() for p in policies.values()}
    assert len(donors) == 1
    (donor,) = donors
    assert donor in names  # never the fresh key, whatever it reports
    assert policies[donor].decide(float(num_digests)) is None
    for name, p in policies.items():
        decision = p.decide(float(num_digests))
        assert decision is None or decision.donor == donor
        if decision is not None:  # only the replicas beyond the threshold of the donor
            assert decision.distance > p.config.threshold
        if max(lineages[names.index(name)], lineages[names.index(donor)]) <= 0.004:
            assert decision is None  # honest noise apart: ~0.006 at most


def test_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="period_s"):
        RealignConfig(period_s=0)
    with pytest.raises(ValueError, match="max_attempts"):
        RealignConfig(period_s=1, max_attempts=0)


def test_a_drift_that_holds_at_one_applied_set_for_a_period_realigns() -> None:
    """Once updates stop (a swarm lingering, or publishing slowly) the applied set stays at
    one digest: two digests a period apart never come. The drift held there for a period
    is enough (bench.scale at N = 8 ended with one applied set and drift 0.22)."""
    p = policy("node2")
    feed(p, swarm(THREE, 0), 0.0)
    feed(p, swarm(THREE, 0), 0.5)
    assert p.decide(0.5) is None  # held for less than a period
    feed(p, swarm(THREE, 0), 1.0)
    realign = p.decide(1.0)
    assert isinstance(realign, Realign) and realign.donor == "node0"
    quiet = policy("node1")  # honest noise held as long: nothing
    for t in (0.0, 1.0, 2.0):
        feed(quiet, swarm(THREE, 0), t)
    assert quiet.decide(2.0) is None


def test_a_resketch_at_one_digest_restarts_how_long_the_drift_held() -> None:
    p = policy("node2")
    feed(p, swarm(THREE, 0), 0.0)
    feed(p, swarm({**THREE, "node2": 0.12}, 0), 0.9)  # another sketch at the same digest
    feed(p, swarm({**THREE, "node2": 0.12}, 0), 1.5)
    assert p.decide(1.5) is None  # held 0.6 s since the resketch
    feed(p, swarm({**THREE, "node2": 0.12}, 0), 2.0)
    assert isinstance(p.decide(2.0), Realign)
