"""Follow the group (dht/grouping_follow.py, wired in dht/group_exchange.py): a member whose
last round of a group ended alone waits, bounded, for its group's next round and joins it;
everyone else opens at once, as before."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.group_exchange import GroupExchange
from dht.grouping_follow import Follower, FollowWait, follow_s
from merge.group_update import Abandoned, ContributionHeader, GroupUpdate, RoundFields
from merge.identity import Identity

RUN = "run-follow"
KEY = "groups.0b"  # the root group: every peer is a member
NUMEL = 5
POOL = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.peer_id)
ME = POOL[0].peer_id
REASONS = ["below_quorum", "cosign_timeout", "reducer_lost", "late", None]

# ---- the decision -------------------------------------------------------------------------


def _alone_after(round_: int = 3) -> Follower:
    follower = Follower(ME)
    follower.ended((KEY, 0, round_), "below_quorum", frozenset({ME}))
    return follower


@settings(max_examples=100, deadline=None)
@given(
    wait_s=st.floats(0.01, 600.0),
    steps=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=30),
    highest=st.integers(-1, 4),
)
def test_a_lone_member_never_waits_past_its_bound(
    wait_s: float, steps: list[float], highest: int
) -> None:
    wait = _alone_after().wait((KEY, 0, 4), 10.0, None, wait_s)
    assert wait is not None and wait.until == wait.since + follow_s(wait_s)
    now = wait.since
    for step in steps:  # nobody's part of round 4 ever comes
        now += step
        ended = wait.ended(now, None, highest)
        assert (ended is None) == (now < wait.until)
        if ended is not None:
            assert ended == "bound"


@settings(max_examples=200, deadline=None)
@given(
    wait_s=st.floats(0.01, 600.0),
    later_s=st.floats(0.0, 1e4),
    first_seen=st.floats(0.0, 1e4),
    highest=st.integers(-1, 10),
)
def test_a_member_that_hears_a_part_of_its_next_round_joins_it(
    wait_s: float, later_s: float, first_seen: float, highest: int
) -> None:
    wait = _alone_after().wait((KEY, 0, 4), 10.0, None, wait_s)
    assert wait is not None
    assert wait.ended(10.0 + later_s, first_seen, highest) == "part"
    # already here when it was ready: it opens (joins) at once, no wait at all
    assert _alone_after().wait((KEY, 0, 4), 10.0, first_seen, wait_s) is None


def test_a_part_of_a_later_round_ends_the_wait_the_member_is_behind() -> None:
    wait = _alone_after().wait((KEY, 0, 4), 0.0, None, 10.0)
    assert wait is not None
    assert [wait.ended(1.0, None, h) for h in (3, 4, 5)] == [None, None, "group_ahead"]


@settings(max_examples=300, deadline=None)
@given(
    reason=st.sampled_from(REASONS),
    others=st.sets(st.sampled_from([p.peer_id for p in POOL[1:]])),
    with_me=st.booleans(),
    wait_s=st.floats(0.01, 600.0),
)
def test_members_in_step_never_wait(
    reason: str | None, others: set[str], with_me: bool, wait_s: float
) -> None:
    """Only `below_quorum` with nobody else's part makes a member wait, and then only in the
    same group, for a later round."""
    follower = Follower(ME)
    follower.ended((KEY, 0, 3), reason, frozenset(others | ({ME} if with_me else set())))
    waits = follower.wait((KEY, 0, 4), 0.0, None, wait_s) is not None
    assert waits == (reason == "below_quorum" and not others)
    assert follower.wait((KEY, 0, 3), 0.0, None, wait_s) is None  # not a later round
    assert follower.wait(("groups.0b1", 0, 4), 0.0, None, wait_s) is None  # another group
    follower.ended((KEY, 0, 4), None, frozenset({ME}))  # it completed the next one
    assert follower.wait((KEY, 0, 5), 0.0, None, wait_s) is None
    follower.ended((KEY, 0, 5), "below_quorum", frozenset({ME}))
    follower.ended(("groups.0b1", 1, 6), reason, frozenset(others))  # a round elsewhere since
    assert follower.wait((KEY, 2, 7), 0.0, None, wait_s) is None


def test_a_new_epoch_of_the_group_still_follows() -> None:
    assert isinstance(_alone_after().wait((KEY, 1, 0), 0.0, None, 1.0), FollowWait)


# ---- the exchange: three members, one out of step ahead of the others ---------------------

WAIT_S = 0.4
COSIGN_S = 0.4


class _Info:
    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id


def _swarm() -> tuple[dict[str, GroupExchange], list[tuple[str, dict[str, Any]]]]:
    """Three exchanges whose streams deliver to each other in-process (the real handlers)."""
    nodes: dict[str, GroupExchange] = {}
    events: list[tuple[str, dict[str, Any]]] = []
    handlers = {"group-part": "rpc_part", "group-cosign": "rpc_cosign", "group-done": "rpc_done"}
    for identity in POOL:
        network = SimpleNamespace(identity=identity, config=SimpleNamespace(run_id=RUN))
        node = GroupExchange(
            network,  # type: ignore[arg-type]
            numel=NUMEL,
            reject=lambda *_: None,
            is_alive=lambda _: True,
            on_event=lambda name, **fields: events.append((name, fields)),
        )

        async def send(
            peer: str, name: str, blob: bytes, timeout_s: float, me: str = identity.peer_id
        ) -> bool:
            handler = getattr(nodes[peer], handlers[name])
            asyncio.ensure_future(handler(_Info(me), blob, None))
            return True

        async def receive(name: str, sender: str, reader: Any, max_bytes: int) -> bytes:
            return reader  # the blob itself

        node._send = send  # type: ignore[method-assign]
        node._receive = receive  # type: ignore[method-assign]
        nodes[identity.peer_id] = node
    return nodes, events


async def _member(node: GroupExchange, round_: int, after_s: float) -> GroupUpdate | Abandoned:
    await asyncio.sleep(after_s)
    identity = node.identity
    tensor = torch.randn(NUMEL, generator=torch.Generator().manual_seed(round_))
    fields = RoundFields(
        run_id=RUN, group_key=KEY, epoch=0, round=round_, learners=3, base_applied=0,
        published_applied=0,
    )  # fmt: skip
    header = ContributionHeader.of(tensor, identity, fields, tokens=100)
    members = [p.peer_id for p in POOL]
    return await node.run(header, tensor, members, wait_s=WAIT_S, cosign_s=COSIGN_S)


def test_a_member_that_ended_its_round_alone_joins_its_groups_next_round() -> None:
    """Round 1: the first member alone (`below_quorum`). Round 2: it is ready 1.5 join windows
    before the other two. Without following it opened round 2 alone again and the others
    were `late` for it (session 25, phase25 (c)); now it waits, joins, and all three complete."""
    nodes, events = _swarm()
    first, *others = nodes.values()

    async def rounds() -> list[GroupUpdate | Abandoned]:
        alone = await _member(first, 1, 0.0)
        assert alone == Abandoned("below_quorum")
        return list(
            await asyncio.gather(
                _member(first, 2, 0.0), *(_member(n, 2, 1.5 * WAIT_S) for n in others)
            )
        )

    outcomes = asyncio.run(rounds())
    assert all(isinstance(o, GroupUpdate) for o in outcomes), outcomes
    followed = [f for name, f in events if name == "group_followed"]
    assert len(followed) == 1 and followed[0]["ended"] == "part" and followed[0]["round"] == 2
    assert 1.5 * WAIT_S - 0.1 < followed[0]["waited_s"] < follow_s(WAIT_S)


def test_a_member_alone_opens_its_next_round_after_its_bound() -> None:
    nodes, events = _swarm()
    first = nodes[ME]

    async def rounds() -> tuple[float, GroupUpdate | Abandoned]:
        await _member(first, 1, 0.0)
        start = time.monotonic()
        outcome = await _member(first, 2, 0.0)
        return time.monotonic() - start, outcome

    took_s, outcome = asyncio.run(rounds())
    assert outcome == Abandoned("below_quorum")  # it opened as before, once the wait was over
    [followed] = [f for name, f in events if name == "group_followed"]
    assert followed["ended"] == "bound"
    assert follow_s(WAIT_S) <= followed["waited_s"] < follow_s(WAIT_S) + 0.2
    assert took_s >= follow_s(WAIT_S) + WAIT_S
