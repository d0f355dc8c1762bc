"""Signed group-done notices (dht/group_notice.py): a notice is acted on only when signed by
its sender, a member of its round (and of this node's list of that group's epoch), for the
run, at most one round past the highest this node knows; every other is refused with its
reason, and a forged or inflated notice changes nothing a peer wants."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.group_exchange import GroupExchange
from dht.group_notice import (
    Done,
    SignedDone,
    decode_notice,
    notice_refusal,
)
from dht.grouping import member_check, peer_bits
from dht.grouping_wire import GroupMessageError
from merge.identity import Identity

RUN = "run-notice"
KEY = "groups.0b0"


def _pool(inside: int, outside: int) -> tuple[list[Identity], list[Identity]]:
    """Fresh keys until `inside` of them fall in the group's prefix "0" and `outside` do not
    (16 random keys had fewer than 4 inside once in CI: a 0.2 % draw)."""
    ins: list[Identity] = []
    outs: list[Identity] = []
    while len(ins) < inside or len(outs) < outside:
        identity = Identity.generate()
        (ins if peer_bits(RUN, identity.peer_id).startswith("0") else outs).append(identity)
    return ins, outs


INSIDE, OUTSIDE = _pool(inside=8, outside=8)
POOL = INSIDE + OUTSIDE


def _done(round_: int = 5, included: tuple[str, ...] | None = None) -> Done:
    ids = included or tuple(sorted(i.peer_id for i in INSIDE[:3]))
    return Done(KEY, 1, round_, ids)


def _refusal(
    notice: SignedDone, sender: str, members: frozenset[str] | None = None, highest: int = 5
) -> str | None:
    return notice_refusal(
        notice,
        sender,
        RUN,
        in_group=member_check(RUN, KEY),
        members=members,
        highest_round=highest,
    )


def test_a_signed_notice_round_trips_and_is_taken() -> None:
    signer = INSIDE[0]
    notice = SignedDone.of(_done(), signer, RUN)
    back = decode_notice(notice.to_bytes())
    assert back == notice and back.verified()
    assert _refusal(back, signer.peer_id, frozenset(_done().included)) is None


def test_an_unsigned_notice_is_refused() -> None:
    old = b"DGD1" + b'{"group_key":"groups.0b0","epoch":1,"round":5,"included":["x"]}'
    with pytest.raises(GroupMessageError) as exc:
        decode_notice(old)
    assert exc.value.reason == "unsigned"


@pytest.mark.parametrize(
    "blob", [b"", b"DGD3", b"DGD3{", b"DGD3[]", b"DGD3" + b'{"group_key": 1}', "text"]
)
def test_a_malformed_notice_is_refused(blob: object) -> None:
    with pytest.raises(GroupMessageError) as exc:
        decode_notice(blob)
    assert exc.value.reason == "malformed"


def test_a_notice_with_a_short_signature_is_malformed() -> None:
    notice = replace(SignedDone.of(_done(), INSIDE[0], RUN), signature=b"\x00" * 10)
    with pytest.raises(GroupMessageError):
        decode_notice(notice.to_bytes())


def test_a_notice_signed_by_another_key_is_refused() -> None:
    signer, other = INSIDE[0], INSIDE[1]
    forged = replace(SignedDone.of(_done(), other, RUN), signer=signer.peer_id)
    assert _refusal(forged, signer.peer_id) == "bad_signature"


def test_a_notice_whose_fields_were_changed_is_refused() -> None:
    signer = INSIDE[0]
    notice = SignedDone.of(_done(round_=3), signer, RUN)
    inflated = replace(notice, done=_done(round_=4))
    assert _refusal(inflated, signer.peer_id) == "bad_signature"


def test_a_notice_relayed_by_another_peer_is_refused() -> None:
    notice = SignedDone.of(_done(), INSIDE[0], RUN)
    assert _refusal(notice, INSIDE[1].peer_id) == "wrong_sender"


def test_a_notice_of_another_run_is_refused() -> None:
    notice = SignedDone.of(_done(), INSIDE[0], "another-run")
    assert _refusal(notice, INSIDE[0].peer_id) == "wrong_run"


def test_a_notice_from_outside_the_group_or_the_round_is_refused() -> None:
    stranger = OUTSIDE[0]
    included = (*_done().included, stranger.peer_id)
    notice = SignedDone.of(_done(included=included), stranger, RUN)
    assert _refusal(notice, stranger.peer_id) == "not_a_member"
    left_out = INSIDE[3]  # inside the prefix, not in the round's included set
    notice = SignedDone.of(_done(), left_out, RUN)
    assert _refusal(notice, left_out.peer_id) == "not_a_member"


def test_a_notice_from_a_member_outside_this_nodes_list_is_refused() -> None:
    signer = INSIDE[0]
    notice = SignedDone.of(_done(), signer, RUN)
    others = frozenset(i.peer_id for i in INSIDE[1:3])
    assert _refusal(notice, signer.peer_id, members=others) == "not_listed"


def test_a_notice_past_the_next_round_is_refused() -> None:
    signer = INSIDE[0]
    assert _refusal(SignedDone.of(_done(round_=6), signer, RUN), signer.peer_id) is None
    notice = SignedDone.of(_done(round_=7), signer, RUN)
    assert _refusal(notice, signer.peer_id) == "too_far"
    assert _refusal(notice, signer.peer_id, highest=-1) == "too_far"


# ---- the exchange: a forged or inflated notice changes nothing -------------------------------


class _Info:
    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id


def _node(
    me: Identity, applied: dict[str, int] | None = None
) -> tuple[GroupExchange, list[tuple[str, int, str]], list[str]]:
    offers: list[tuple[str, int, str]] = []
    rejected: list[str] = []
    network = SimpleNamespace(identity=me, config=SimpleNamespace(run_id=RUN))
    node = GroupExchange(
        network,  # type: ignore[arg-type]
        numel=4,
        reject=lambda reason, peer, detail: rejected.append(reason),
        is_alive=lambda _: True,
        offer=lambda key, seq, holder: offers.append((key, seq, holder)),
        applied_seq=lambda key: (applied or {}).get(key, 0),
    )
    return node, offers, rejected


async def _deliver(node: GroupExchange, sender: str, blob: bytes) -> None:
    async def receive(reader: object, **_: object) -> bytes:
        return blob

    import dht.group_exchange_reads as ge  # where the exchange reads a stream

    original, ge.receive_blob = ge.receive_blob, receive  # type: ignore[assignment]
    try:
        await node.rpc_done(_Info(sender), None, None)
        await asyncio.gather(*node._tasks)
    finally:
        ge.receive_blob = original


@settings(max_examples=40, deadline=None)
@given(
    round_=st.integers(0, 200),
    highest=st.integers(-1, 100),
    signer_index=st.integers(0, len(POOL) - 1),
    sender_index=st.integers(0, len(POOL) - 1),
    tamper=st.sampled_from(["none", "round", "included", "signature", "run"]),
)
def test_a_forged_or_inflated_notice_makes_this_node_want_nothing(
    round_: int, highest: int, signer_index: int, sender_index: int, tamper: str
) -> None:
    me = OUTSIDE[-1]  # a node outside the group: an accepted notice becomes a want (offer)
    node, offers, rejected = _node(me)
    if highest >= 0:
        node.highest_round["groups.0b1"] = highest
    signer, sender = POOL[signer_index], POOL[sender_index]
    included = tuple(sorted({signer.peer_id, *(i.peer_id for i in INSIDE[:2])}))
    notice = SignedDone.of(Done(KEY, 1, round_, included), signer, RUN)
    if tamper == "round":
        notice = replace(notice, done=Done(KEY, 1, round_ + 1, included))
    elif tamper == "included":
        notice = replace(notice, done=Done(KEY, 1, round_, included[:-1] or included + ("x",)))
    elif tamper == "signature":
        notice = replace(notice, signature=bytes(64))
    elif tamper == "run":
        notice = SignedDone.of(Done(KEY, 1, round_, included), signer, "other-run")
    asyncio.run(_deliver(node, sender.peer_id, notice.to_bytes()))
    honest = (
        tamper == "none"
        and signer is sender
        and member_check(RUN, KEY)(signer.peer_id)
        and round_ <= highest + 1
    )
    if honest:
        assert offers == [(KEY, round_ + 1, sender.peer_id)] and not rejected
    else:
        assert offers == [] and len(rejected) == 1


def test_a_group_ahead_is_followed_one_round_past_what_the_replica_applied() -> None:
    """Groups drift apart (session 14's run: one group 10 rounds ahead). A notice of a group
    ahead of this node's own is taken one round past that group's last applied update."""
    me, signer = OUTSIDE[-1], INSIDE[0]
    included = tuple(sorted(i.peer_id for i in INSIDE[:2]))
    node, offers, rejected = _node(me, applied={KEY: 15})  # rounds up to 14 applied
    node.highest_round["groups.0b1"] = 4  # this node's own group is at round 4
    for round_ in (15, 16):
        notice = SignedDone.of(Done(KEY, 1, round_, included), signer, RUN)
        asyncio.run(_deliver(node, signer.peer_id, notice.to_bytes()))
    assert offers == [(KEY, 16, signer.peer_id)] and rejected == ["group_done_too_far"]
