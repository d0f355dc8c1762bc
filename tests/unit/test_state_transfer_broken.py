"""A state download whose stream breaks (the donor died mid-transfer, a relayed link reset)
counts nothing against the donor; one whose donor sent what we will not read does.

Session 19's 16-node bench (4 SIGKILLs) counted 2 `bad_state` against honest donors: a
broken stream was a TransportError like a lie. The download loop is driven here with its
donors and transfers replaced; tests/swarm prove the transfer itself."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from dht.p2pd import DialError
from dht.state_check import StateCheckError
from dht.state_donors import Skipped
from dht.state_refusal import BUSY, StateRefusal
from dht.state_transfer import StateTransfer
from dht.transport import StreamBroken, TransportError


def transfer(failure: Exception) -> tuple[StateTransfer, list[tuple[str, str]]]:
    rejected: list[tuple[str, str]] = []
    node = object.__new__(StateTransfer)
    node.config = SimpleNamespace(heartbeat_period_s=0.01, initial_peers=[])  # type: ignore[assignment]
    node.join_patience_s = 0.5  # several passes even on a loaded machine
    node._reject = lambda reason, peer, detail: rejected.append((reason, peer))  # type: ignore[assignment,misc]

    async def poll() -> None:
        return None

    node.membership = SimpleNamespace(peers={}, poll=poll, alive_peers=lambda: [])  # type: ignore[assignment]
    node.replica = SimpleNamespace(num_applied=0)  # type: ignore[assignment]

    async def donors(alive: list[Any]) -> list[Any]:
        return [SimpleNamespace(peer_id="donor", num_applied=5, serves_state=True)]

    async def download_from(peer_id: str) -> None:
        raise failure

    node._donors = donors  # type: ignore[method-assign]
    node._download_from = download_from  # type: ignore[method-assign,assignment]
    return node, rejected


@pytest.mark.parametrize(
    "failure",
    [
        StreamBroken("peer closed the state stream early"),
        StreamBroken("no progress in 3 attempts: peer closed the stream early"),
        TimeoutError(),  # the whole transfer ran past its deadline (asyncio.timeout)
        DialError("no address of the donor dialed"),
    ],
)
def test_a_broken_or_timed_out_stream_is_tried_again_and_counted_against_nobody(
    failure: Exception,
) -> None:
    """Before, a realignment whose download timed out or whose dial failed was counted as
    `bad_state` against the donor, like a lie: the events could not tell them apart."""
    node, rejected = transfer(failure)
    skipped = asyncio.run(node.download())
    assert isinstance(skipped, Skipped) and skipped.reason == "timed_out"
    assert skipped.refusals["unreachable"] >= 2  # tried again within the join's patience
    refusal = asyncio.run(node.realign("donor"))
    assert isinstance(refusal, StateRefusal) and refusal.reason == "unreachable"
    assert refusal.check == type(failure).__name__
    assert rejected == []


def test_a_busy_donor_is_counted_against_nobody() -> None:
    node, rejected = transfer(TransportError(f"peer refused: {BUSY}"))
    refusal = asyncio.run(node.realign("donor"))
    assert isinstance(refusal, StateRefusal) and refusal.reason == "busy"
    assert rejected == []


def test_a_donor_that_sent_what_we_will_not_read_is_counted() -> None:
    node, rejected = transfer(TransportError("peer sent more than the size it announced"))
    skipped = asyncio.run(node.download())
    assert isinstance(skipped, Skipped) and skipped.reason == "all_refused"
    assert skipped.refusals == {"bad_state": 1}  # a liar is not asked twice
    refusal = asyncio.run(node.realign("donor"))
    assert isinstance(refusal, StateRefusal)
    assert (refusal.reason, refusal.check) == ("bad_state", "transport")
    assert rejected and set(rejected) == {("bad_state", "donor")}


def test_a_refused_state_says_which_check_refused_it_and_what_it_measured() -> None:
    """What the `realign_refused` event reports."""
    measured = {"nearest": 0.61, "median": 0.9, "spread": 0.7}
    failure = StateCheckError(
        "far from its digest's peers", check="same_digest", distances=measured
    )
    node, rejected = transfer(failure)
    refusal = asyncio.run(node.realign("donor"))
    assert isinstance(refusal, StateRefusal)
    assert (refusal.reason, refusal.check) == ("bad_state", "same_digest")
    assert refusal.distances == measured
    assert rejected == [("bad_state", "donor")]
