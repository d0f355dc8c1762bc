"""The settle's donor passes the state check when replicas with one applied set sit far apart
(bench.scale --sizes 16: 0.5-1.7 of the params' norm), and a poisoned donor there does not."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.heartbeat import Heartbeat
from dht.realign_settle import settle_donor
from dht.state_check import (
    MAX_DISTANCE,
    MAX_DRIFT,
    StateCheckError,
    applied_digest,
    check_donor_state,
    same_digest_spread,
)
from merge.sketch import relative_distance
from tests.unit.test_state_check import APPLIED, PARAMS, SKETCH, donor_state, sketch_state

NUM_REPLICAS = 16


def spread_replicas(seed: int, scale: float) -> dict[str, torch.Tensor]:
    """16 replicas at one applied set, each the common point plus its own weighing error of
    `scale` x (0.3 .. 1.2) of the params' norm: pairwise ~0.5-1.7 apart at scale 1."""
    generator = torch.Generator().manual_seed(seed)
    norm = float(PARAMS.norm())
    replicas = {}
    for i in range(NUM_REPLICAS):
        error = torch.randn(PARAMS.numel(), generator=generator)
        size = scale * (0.3 + 0.9 * float(torch.rand(1, generator=generator)))
        replicas[f"node{i:02d}"] = PARAMS + error / error.norm() * size * norm
    return replicas


def heartbeat(peer_id: str, params: torch.Tensor) -> Heartbeat:
    return Heartbeat(
        peer_id=peer_id, latest_seq=3, applied_digest=applied_digest(APPLIED),
        sketch=SKETCH(params), num_applied=5,
    )  # fmt: skip


def the_settle(replicas: dict[str, torch.Tensor]) -> tuple[str, list[Heartbeat]]:
    """The donor every replica computes alike (weights: one each), and every heartbeat."""
    beats = [heartbeat(p, params) for p, params in replicas.items()]
    sketches = {h.peer_id: tuple(h.sketch) for h in beats}
    donor = settle_donor(sketches, dict.fromkeys(sketches, 1), sketches)
    assert donor is not None
    return donor, beats


def check_on(realigner: str, donor: str, params: torch.Tensor, beats: list[Heartbeat]) -> str:
    """What `realigner` runs on `donor`'s state (its live peers are everyone but itself):
    how the peers at the digest agreed with it."""
    peers = [h for h in beats if h.peer_id != realigner]
    return check_donor_state(donor_state(params, APPLIED), donor, peers, sketch_state).agreed_by


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31), st.floats(1.0, 1.5))
def test_every_replica_accepts_the_settle_donor_of_a_far_spread_swarm(
    seed: int, scale: float
) -> None:
    """Measured at 16 nodes: nobody sits within MAX_DRIFT of the medoid and its median
    distance exceeds MAX_DISTANCE, so the nearest-peer rule and the fixed distance bound
    refused it on every replica (the deadlock). It lies no farther from the others than they
    lie from each other: accepted everywhere."""
    replicas = spread_replicas(seed, scale)
    donor, beats = the_settle(replicas)
    others = [h for h in beats if h.peer_id != donor]
    distances = [relative_distance(SKETCH(replicas[donor]), h.sketch) for h in others]
    assert all(d is not None and d > MAX_DRIFT for d in distances)  # the old rule's refusal
    assert sorted(d for d in distances if d is not None)[len(distances) // 2] > MAX_DISTANCE
    for realigner in replicas:
        if realigner != donor:
            assert check_on(realigner, donor, replicas[donor], beats) == "spread"


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31), st.floats(1.0, 1.5))
def test_a_poisoned_donor_behind_the_far_spread_swarms_digest_is_refused(
    seed: int, scale: float
) -> None:
    """The donor serves its own point moved by twice the honest spread: farther from the
    others than they are from each other, refused by every replica, naming the check."""
    replicas = spread_replicas(seed, scale)
    donor, beats = the_settle(replicas)
    others = [h for h in beats if h.peer_id != donor]
    spread = same_digest_spread(others, dict.fromkeys((h.peer_id for h in others), 1))
    assert spread is not None
    noise = torch.randn(PARAMS.numel(), generator=torch.Generator().manual_seed(seed + 1))
    poisoned = replicas[donor] + noise / noise.norm() * 2 * spread * float(PARAMS.norm())
    for realigner in replicas:
        if realigner != donor:
            try:
                check_on(realigner, donor, poisoned, beats)
            except StateCheckError as exc:
                assert exc.check == "same_digest"
                assert exc.distances["median"] > exc.distances["spread"]
            else:
                raise AssertionError(f"{realigner} accepted a poisoned state")


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**31))
def test_in_a_swarm_that_agrees_the_attacks_poisoned_donor_is_refused(seed: int) -> None:
    """bench.attack's poisoner (noise of the params' own norm) behind an applied set that
    honest replicas hold within a per cent of each other: the spread grants it nothing."""
    replicas = spread_replicas(seed, 0.01)
    donor, beats = the_settle(replicas)
    noise = torch.randn(PARAMS.numel(), generator=torch.Generator().manual_seed(seed + 1))
    poisoned = replicas[donor] + noise * float(PARAMS.norm()) / PARAMS.numel() ** 0.5
    realigner = next(p for p in replicas if p != donor)
    assert check_on(realigner, donor, replicas[donor], beats) == "nearest"
    try:
        check_on(realigner, donor, poisoned, beats)
    except StateCheckError as exc:
        assert exc.check == "same_digest"
    else:
        raise AssertionError("a poisoned state was accepted")


def test_one_far_accomplice_at_the_digest_does_not_widen_the_spread() -> None:
    """Two honest replicas a per cent apart and a second key of the poisoner reporting their
    applied set far away: the spread stays the honest one, the poisoned state is refused."""
    near = spread_replicas(7, 0.01)
    noise = torch.randn(PARAMS.numel(), generator=torch.Generator().manual_seed(8))
    poisoned = PARAMS + noise * float(PARAMS.norm()) / PARAMS.numel() ** 0.5
    beats = [heartbeat("carol", near["node00"]), heartbeat("dave", near["node01"])]
    accomplice = heartbeat("mallory2", poisoned)
    spread = same_digest_spread(
        [*beats, accomplice], dict.fromkeys(["carol", "dave", "mallory2"], 1)
    )
    assert spread is not None and spread < 0.05
    try:
        check_donor_state(
            donor_state(poisoned, APPLIED), "mallory", [*beats, accomplice], sketch_state
        )
    except StateCheckError as exc:
        assert exc.check == "distance"
    else:
        raise AssertionError("a poisoned state was accepted")


def test_a_refusal_names_its_check_and_distances() -> None:
    """What the realign_refused event reports."""
    beats = [heartbeat("carol", PARAMS)]
    try:
        check_donor_state(donor_state(PARAMS + 0.5, APPLIED), "donor", beats, sketch_state)
    except StateCheckError as exc:
        assert exc.check == "same_digest"
        assert exc.distances["nearest"] > MAX_DRIFT
        assert "spread" not in exc.distances  # one peer there: no spread to measure
    else:
        raise AssertionError("a state far from the only peer at its digest was accepted")
