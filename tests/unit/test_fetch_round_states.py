"""A fetch round's state blocks by their digest through the real exchange code (dht.
group_exchange_fetch `_with_states`; docs/scale.md, Session 28: blocks28). Three members on
real pipelines, the streams the in-memory pipe of tests/unit/test_fetch_round_sums.py: at one
state no member sends its blocks (`states`) and the round applies; when one member's replica
differs, only it and each other member exchange blocks (never the two alike), and the round
decides as the full blocks decide: past the slack it runs between the two alike members and
the third is left out ("left_out_state"), within the slack all three apply it. Nobody is
counted as refusing."""

from __future__ import annotations

import asyncio

import pytest
import torch

from dht.shard_fetch_wire import decode_fetch
from tests.unit.test_fetch_round_sums import (
    MEMBERS,
    NUMEL,
    OTHERS,
    OWN_UPDATE,
    Loopback,
    Member,
    _holders_keep,
)


class Recording(Loopback):
    """The pipe, with who sent which kind to whom."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, str, str]] = []

    async def deliver(self, sender: str, peer: str, name: str, blob: bytes) -> bytes:
        if name == "group-fetch":
            self.sent.append((sender, peer, decode_fetch(blob, NUMEL).kind))
        return await super().deliver(sender, peer, name, blob)


def _round(odd_scale: float) -> tuple[list[Member], Recording, str]:
    """The members' round over two other updates, the last member in sorted order's params
    moved by `odd_scale` (relative) in its own slice's last value; the members, the pipe
    and the odd member."""
    hub = Recording()
    others = sorted(OTHERS, key=lambda u: (u.head.group_key, u.seq))[:2]

    async def run() -> list[Member]:
        members = [Member(hub, identity, OWN_UPDATE) for identity in MEMBERS]
        _holders_keep(hub, others, members)
        if odd_scale:
            params = _odd(members).pipeline.replica.params
            params[-1] = params[-1] * (1 + odd_scale) + odd_scale
        ids = sorted(m.peer_id for m in MEMBERS)
        await asyncio.wait_for(
            asyncio.gather(*(m.exchange._fetch_round(OWN_UPDATE, ids) for m in members)), 30.0
        )
        return members

    members = asyncio.run(run())
    return members, hub, _odd(members).exchange.identity.peer_id


def _odd(members: list[Member]) -> Member:
    return max(members, key=lambda m: m.exchange.identity.peer_id)


def _outcome(member: Member) -> str:
    (event,) = [e for e in member.events if e["event"] == "shard_round"]
    return event["outcome"]


def test_members_at_one_state_send_no_blocks_and_apply_the_round() -> None:
    members, hub, _ = _round(0.0)
    assert [kind for _, _, kind in hub.sent if kind == "states"] == []
    assert [_outcome(m) for m in members] == ["applied"] * 3
    assert all(m.rejections == [] for m in members)
    first = members[0].pipeline.replica.params
    assert all(torch.equal(m.pipeline.replica.params, first) for m in members)


@pytest.mark.parametrize(("scale", "odd_outcome"), [(0.5, "left_out_state"), (1e-6, "applied")])
def test_only_members_whose_digests_differ_exchange_blocks_and_decide_as_before(
    scale: float, odd_outcome: str
) -> None:
    members, hub, odd = _round(scale)
    states = sorted((s, p) for s, p, kind in hub.sent if kind == "states")
    alike = sorted(
        m.exchange.identity.peer_id for m in members if m.exchange.identity.peer_id != odd
    )
    assert states == sorted([(odd, a) for a in alike] + [(a, odd) for a in alike])
    for member in members:
        mine = member.exchange.identity.peer_id
        assert _outcome(member) == (odd_outcome if mine == odd else "applied")
        assert member.rejections == []
