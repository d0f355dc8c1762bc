"""A newcomer refuses a donor's state that the other live peers' heartbeats contradict."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch

from dht.heartbeat import Heartbeat
from dht.state_check import StateCheckError, applied_digest, check_donor_state
from dht.state_transfer import check_with_fresh_heartbeats
from merge.sketch import ReplicaSketch

SKETCH = ReplicaSketch(1000, "f" * 64)
PARAMS = torch.linspace(-1, 1, 1000)
APPLIED = {"alice": [1, 2, 3], "bob": [1, 2]}


def peer(peer_id: str, *, latest_seq: int = 0, params: torch.Tensor = PARAMS) -> Heartbeat:
    return Heartbeat(
        peer_id=peer_id, latest_seq=latest_seq, applied_digest=applied_digest(APPLIED),
        sketch=SKETCH(params), num_applied=5,
    )  # fmt: skip


PEERS = [peer("alice", latest_seq=3), peer("bob", latest_seq=2), peer("donor")]


def test_an_honest_state_passes() -> None:
    state = {"applied": APPLIED, "params": PARAMS.clone(), "num_applied": 5}
    check_donor_state(state, "donor", PEERS, SKETCH)


def test_a_state_claiming_updates_nobody_published_is_refused() -> None:
    """Seqs far ahead would make every later honest update of alice look like a replay."""
    state = {"applied": {**APPLIED, "alice": [1, 2, 3, 1000]}, "params": PARAMS}
    with pytest.raises(StateCheckError, match="update 1000 of alice"):
        check_donor_state(state, "donor", PEERS, SKETCH)


def test_poisoned_parameters_behind_an_honest_applied_set_are_refused() -> None:
    state = {"applied": APPLIED, "params": PARAMS + 0.5}
    with pytest.raises(StateCheckError, match="parameters differ"):
        check_donor_state(state, "donor", PEERS, SKETCH)


def test_the_donors_own_heartbeat_vouches_for_nothing() -> None:
    liar = peer("donor", params=PARAMS + 0.5)
    state = {"applied": APPLIED, "params": PARAMS + 0.5}
    with pytest.raises(StateCheckError):
        check_donor_state(state, "donor", [*PEERS[:2], liar], SKETCH)


def _fresh_heartbeats(reads: list[list[Heartbeat]]) -> tuple[Callable[[], list[Heartbeat]], Any]:
    """alive_peers() answers reads[0] until poll() moves on to the next read."""
    polls = 0

    def alive() -> list[Heartbeat]:
        return reads[min(polls, len(reads) - 1)]

    async def poll() -> None:
        nonlocal polls
        polls += 1

    return alive, poll


def test_a_state_ahead_of_its_authors_last_heartbeat_passes_once_fresh_ones_announce_it() -> None:
    """Rounds shorter than a heartbeat period: alice's state holds her update 5 while her last
    heartbeat still says 3; her next heartbeat says 5."""
    state = {"applied": {**APPLIED, "alice": [1, 2, 3, 4, 5]}, "params": PARAMS}
    late = [peer("alice", latest_seq=3), peer("bob", latest_seq=2)]
    fresh = [peer("alice", latest_seq=5), peer("bob", latest_seq=2)]
    alive, poll = _fresh_heartbeats([late, fresh])
    asyncio.run(check_with_fresh_heartbeats(state, "alice", alive, poll, SKETCH, period_s=0.0))


def test_a_state_fresh_heartbeats_still_contradict_is_refused() -> None:
    state = {"applied": {**APPLIED, "alice": [1, 2, 3, 1000]}, "params": PARAMS}
    alive, poll = _fresh_heartbeats([PEERS])
    with pytest.raises(StateCheckError, match="update 1000 of alice"):
        asyncio.run(check_with_fresh_heartbeats(state, "donor", alive, poll, SKETCH, period_s=0.0))
