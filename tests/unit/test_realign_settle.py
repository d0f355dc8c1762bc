"""The settle (dht.realign_settle): replicas at an applied set held long enough end at one
point, the donor a weighted medoid every replica picks alike, each downloading once at most;
realignments while training do not spend it (helpers: tests.unit.test_realign)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.heartbeat import Heartbeat
from dht.realign import Realign
from dht.realign_settle import settle_donor
from merge.sketch import relative_distance
from tests.unit.test_realign import THREE, digest, feed, heartbeat, offset, point, policy, swarm


def beat(
    name: str, sketch: list[float], records: dict[str, int], num_realigned: int = 0
) -> Heartbeat:
    """`name`'s heartbeat at digest 0 with this exact sketch."""
    return Heartbeat(
        peer_id=name, applied_digest=digest(0), sketch=sketch, latest_seq=40,
        merged_by_author=records, num_applied=sum(records.values()),
        num_realigned=num_realigned,
    )  # fmt: skip


def lineage_sketch(name: str, size: float) -> list[float]:
    return [round(p + s, 7) for p, s in zip(point(0), offset(name, size), strict=True)]


def test_a_drift_within_the_threshold_settles_once_the_digest_held_long_enough() -> None:
    """Honest noise (0.003) is left alone while updates come, and between bursts shorter
    than settle_periods; once the applied set holds that long, the replica settles."""
    p = policy("node1")
    for t in range(5):  # 0..4 s: held 4 s, under settle_periods (5)
        feed(p, swarm(THREE, 0), float(t))
        assert p.decide(float(t)) is None
    feed(p, swarm(THREE, 0), 5.0)
    realign = p.decide(5.0)
    assert realign == Realign("node0", realign.distance, settle=True)  # type: ignore[union-attr]
    assert 1e-6 < realign.distance < 0.02  # type: ignore[union-attr]
    donor = policy("node0")
    for t in range(10):
        feed(donor, swarm(THREE, 0), float(t))
        assert donor.decide(float(t)) is None


def test_replicas_within_float_rounding_do_not_settle() -> None:
    names = ["a", "b", "c"]
    records = dict.fromkeys(names, 10)
    base = lineage_sketch("x", 0.0)
    sketches = {"a": base, "b": [v * (1 + 1e-8) for v in base], "c": list(base)}
    policies = {n: policy(n) for n in names}
    for t in range(20):
        for p in policies.values():
            feed(p, [beat(n, sketches[n], records) for n in names], float(t))
            assert p.decide(float(t)) is None


def test_settle_donor_is_the_weighted_medoid_ties_to_the_smallest_id() -> None:
    one, two, far = (0.0,) * 4, (1.0, 0.0, 0.0, 0.0), (9.0, 0.0, 0.0, 0.0)
    weights = {"a": 1, "b": 1, "c": 1}
    assert settle_donor({"a": far, "b": one, "c": two}, weights, "abc") == "c"  # 8 + 1
    assert settle_donor({"a": one, "b": one, "c": one}, weights, "cba") == "a"
    assert settle_donor({"a": far, "b": one, "c": two}, weights, "ab") == "b"  # c serves none
    # a heavy record pulls the medoid to its own point: b 9 x 0 + 9 + 1, c 9 x 1 + 8
    assert settle_donor({"a": far, "b": one, "c": two}, {"a": 1, "b": 9, "c": 1}, "abc") == "b"
    assert settle_donor({"a": one}, {}, "a") is None  # no record: never a donor
    assert settle_donor({}, weights, "abc") is None


def settle_swarm(
    lineages: list[float], counts: list[int]
) -> tuple[list[str], dict[str, list[float]], dict[str, int]]:
    names = [f"node{i}" for i in range(len(lineages))]
    sketches = {n: lineage_sketch(n, lineages[i]) for i, n in enumerate(names)}
    return names, sketches, {n: counts[i] for i, n in enumerate(names)}


@settings(max_examples=60, deadline=None)
@given(
    lineages=st.lists(
        st.sampled_from([0.0, 1e-4, 0.003, 0.004, 0.05, 0.13]), min_size=2, max_size=7
    ),
    counts=st.lists(st.integers(1, 40), min_size=7, max_size=7),
    seeds=st.lists(st.integers(0, 2**32), min_size=7, max_size=7),
    histories=st.lists(st.integers(0, 3), min_size=7, max_size=7),
)
def test_at_a_held_digest_every_replica_picks_the_same_donor_whatever_it_saw_before(
    lineages: list[float], counts: list[int], seeds: list[int], histories: list[int]
) -> None:
    """Each replica saw its own history of earlier digests (different pairs shared different
    latest digests: choose_donor can differ) and the held digest's heartbeats in its own
    order, at its own times: the settle donor is one."""
    names, sketches, records = settle_swarm(lineages, counts)
    policies = {n: policy(n) for n in names}
    for k, (name, p) in enumerate(policies.items()):
        rng = random.Random(seeds[k])
        for i in range(histories[k]):  # earlier digests, some peers seen at each
            seen = [h for h in swarm(dict.fromkeys(names, 0.01), 10 + i) if rng.random() < 0.7]
            own = heartbeat(name, 10 + i, 0.01, records=records)
            p.observe(own, [h for h in seen if h.peer_id != name], float(i))
        for t in range(20):  # the last wave of 6 apart waits 5 + 2 x 3 periods
            beats = [beat(n, sketches[n], records) for n in names]
            rng.shuffle(beats)
            own = next(h for h in beats if h.peer_id == name)
            p.observe(own, [h for h in beats if h.peer_id != name], 10.0 + t + rng.random() / 4)
    donors = {p.settle_donor() for p in policies.values()}
    assert len(donors) == 1
    (donor,) = donors
    assert donor in names and policies[donor].decide(30.0) is None  # type: ignore[index]
    for name, p in policies.items():
        decision = p.decide(30.0)
        apart = relative_distance(sketches[name], sketches[donor])  # type: ignore[index]
        assert (decision is not None) == (apart is not None and apart > 1e-6)
        if decision is not None:  # the donor, or a replica at its point: the same state
            source = sketches[decision.donor]
            assert relative_distance(source, sketches[donor]) <= 1e-6  # type: ignore[index, operator]


@settings(max_examples=40, deadline=None)
@given(
    lineages=st.lists(st.sampled_from([0.0, 1e-4, 0.003, 0.05, 0.13]), min_size=2, max_size=7),
    counts=st.lists(st.integers(1, 40), min_size=7, max_size=7),
    seed=st.integers(0, 2**32),
)
def test_replicas_at_a_held_digest_end_at_one_point_each_downloading_once_at_most(
    lineages: list[float], counts: list[int], seed: int
) -> None:
    """Every replica that decides copies its donor's sketch (its state) and shows it with a
    new lineage; the donor stays the donor while the others copy it, so the swarm ends at
    one point, each replica having realigned once at most."""
    names, sketches, records = settle_swarm(lineages, counts)
    realigned = dict.fromkeys(names, 0)
    rng = random.Random(seed)
    policies = {n: policy(n, cooldown_s=1.0) for n in names}
    now = 0.0
    for _ in range(40):
        now += 1.0
        beats = [beat(n, sketches[n], records, realigned[n]) for n in names]
        for name in rng.sample(names, len(names)):  # one node at a time, in any order
            p = policies[name]
            own = next(h for h in beats if h.peer_id == name)
            p.observe(own, [h for h in beats if h.peer_id != name], now)
            decision = p.decide(now)
            if decision is not None:
                p.started(now, settle=decision.settle)
                p.finished(loaded=True)
                sketches[name] = list(sketches[decision.donor])
                realigned[name] += 1
    assert len({tuple(s) for s in sketches.values()}) == 1
    assert max(realigned.values()) <= 1


def test_a_hostile_fresh_key_at_the_held_digest_makes_nobody_download() -> None:
    """mallory (no update of hers applied) shows a new sketch at the held digest every
    period, claims 500 updates and a fellow fresh key vouches for them: the replicas already
    at one point never download anything, whatever she shows."""
    names = ["a", "b", "c"]
    records = dict.fromkeys(names, 10)
    sketch = lineage_sketch("x", 0.0)
    policies = {n: policy(n, cooldown_s=1.0) for n in names}
    for t in range(200):
        beats = [beat(n, sketch, records) for n in names]
        beats.append(beat("mallory", lineage_sketch(f"m{t}", 0.01 * (t % 7)), {}))
        beats.append(beat("sybil", lineage_sketch("x", 0.0), {"mallory": 500}))
        for p in policies.values():
            feed(p, beats, float(t))
            assert p.decide(float(t)) is None
            assert p.settle_donor() in names


def test_a_hostile_record_holder_swinging_the_donor_costs_max_attempts_per_window() -> None:
    """eve has a record and moves between two sides at the held digest to swing the medoid
    between a and b: c (apart from both) downloads at most max_settles per window."""
    names = ["a", "b", "c", "eve"]
    records = dict.fromkeys(names, 10)
    a, b, c = (lineage_sketch(n, 0.003) for n in "abc")
    sketches = {"a": a, "b": b, "c": c}
    p = policy("c")
    downloads = []
    for t in range(0, 1800, 1):
        eve = a if (t // 10) % 2 else b
        beats = [beat(n, sketches[n], records) for n in "abc"] + [beat("eve", eve, records)]
        feed(p, beats, float(t))
        decision = p.decide(float(t))
        if decision is not None:
            downloads.append(t)
            p.started(float(t), settle=decision.settle)
            p.finished(loaded=False)  # refused: c stays apart
    assert 0 < len(downloads) <= p.config.max_settles


def test_replicas_apart_from_the_donor_settle_two_at_a_time() -> None:
    """A donor serves two downloads at once and refuses more, and a replica that settled
    holds the same state: the seven replicas apart settle two a source, in peer id order,
    each once, from the donor and those already at its point."""
    names = [f"node{i}" for i in range(8)]
    records = dict.fromkeys(names, 10)
    sketches = {n: lineage_sketch(n, 0.003) for n in names}
    policies = {n: policy(n) for n in names}
    waves: dict[float, list[str]] = {}
    served: dict[tuple[float, str], int] = {}
    for t in range(30):
        beats = [
            beat(n, sketches[n], records, num_realigned=int(n in sum(waves.values(), [])))
            for n in names
        ]
        for name, p in policies.items():
            feed(p, beats, float(t))
            decision = p.decide(float(t))
            if decision is not None:
                waves.setdefault(float(t), []).append(name)
                served[(float(t), decision.donor)] = served.get((float(t), decision.donor), 0) + 1
                p.started(float(t), settle=decision.settle)
                p.finished(loaded=True)
                sketches[name] = list(sketches[decision.donor])
    donor = {p.settle_donor() for p in policies.values()}
    assert len(donor) == 1 and len({tuple(s) for s in sketches.values()}) == 1
    assert max(served.values()) <= 2  # no source serves more than two at once
    assert sum(len(wave) for wave in waves.values()) == 7
    # each that settled serves the next (here a download takes no time): 2 from the donor,
    # then 2 from it and 2 from each of the first two
    assert sorted(waves)[0] == 5.0 and [len(w) for _, w in sorted(waves.items())] == [2, 5]


def test_realignments_while_training_do_not_spend_the_settle_and_a_refused_settle_retries() -> None:
    attempts = _settles_after_spent_realignments("node1")  # the donor was busy each time
    assert attempts == [305, 310, 315]  # 5 periods held, then every 5 periods, 3 at most


def test_a_replica_far_from_the_settle_donor_settles_once_its_realignments_are_spent() -> None:
    """node2 (0.13 apart: beyond the threshold) realigned three times while training, so the
    realignments' cap is spent: at the held digest it settles to node0 under the settle's
    own cap, from settle_periods on (before, it never tried again: bench.scale --sizes 16
    ended 1.2 apart with one applied set)."""
    assert _settles_after_spent_realignments("node2") == [305, 310, 315]  # each refused


def test_a_far_replica_with_attempts_left_realigns_after_a_period_then_settles() -> None:
    """With its realignments' cap unspent, the far replica first realigns after a period (as
    at moving digests); refused, it settles once the settle is due, the settle first."""
    p = policy("node2")
    decisions = []
    for t in range(0, 30):
        feed(p, swarm(THREE, 0), float(t))
        decision = p.decide(float(t))
        if decision is not None:
            decisions.append((t, decision.settle))
            p.started(float(t), settle=decision.settle)
            p.finished(loaded=False)
    assert decisions[:2] == [(1, False), (6, True)]


def _settles_after_spent_realignments(me: str) -> list[int]:
    """`me` realigned three times while training (the realignments' cap spent), then holds
    THREE's digest from t = 300 to 400: when it settled, each settle to node0 loading nothing."""
    p = policy(me)
    for t in (0.0, 100.0, 200.0):
        p.started(t)
        p.finished(loaded=True)
    attempts = []
    for t in range(300, 400):
        feed(p, swarm(THREE, 0), float(t))
        decision = p.decide(float(t))
        if decision is not None:
            assert decision.settle and decision.donor == "node0"
            attempts.append(t)
            p.started(float(t), settle=True)
            p.finished(loaded=False)
    return attempts
