"""Slow reducers (dht/grouping_patience.py, dht/grouping_shards.py): one live reducer late with its
co-signed shard gets one more co-sign window, a failed send is tried again (and since session 18
never makes its recipient lost), and a round either completes with every shard co-signed over one
included set of at least a quorum, the same on every member, or is abandoned; never later than
one extra deadline."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dht.group_exchange_shards as group_exchange_shards
from dht.group_exchange import GroupExchange
from dht.grouping_patience import MAX_SEND_TRIES, CosignClock, SendRetry, send_timeout_s
from dht.grouping_shards import ShardedRound, decode_piece, decode_shard, encode_piece, shard_codec
from merge.group_update import Abandoned, GroupUpdate, RoundFields
from merge.identity import Identity
from tests.factories import bf16_values, sharded_rounds

IDS = sorted((Identity.generate() for _ in range(6)), key=lambda i: i.peer_id)
FIELDS = RoundFields(
    run_id="r", group_key="groups.0b", epoch=0, round=2, learners=1, base_applied=0,
    published_applied=0,
)  # fmt: skip
NUMEL = 29
WAIT_S = COSIGN_S = 5.0


def test_the_clock_moves_once_for_one_live_late_reducer() -> None:
    clock = CosignClock(10.0, extension_s=5.0)
    assert not clock.expired(9.9, ["a"], lambda _: True)
    assert not clock.expired(10.0, ["a"], lambda _: True) and clock.deadline == 15.0
    assert not clock.expired(14.9, ["a"], lambda _: True)
    assert clock.expired(15.0, ["a"], lambda _: True)


@pytest.mark.parametrize(
    ("missing", "alive"), [(["a", "b"], True), (["a"], False)], ids=["two_late", "dead"]
)
def test_the_clock_does_not_move_for_two_late_reducers_or_a_dead_one(
    missing: list[str], alive: bool
) -> None:
    clock = CosignClock(10.0, extension_s=5.0)
    assert clock.expired(10.0, missing, lambda _: alive) and clock.deadline == 10.0


def test_nothing_missing_never_expires() -> None:
    assert not CosignClock(10.0, extension_s=5.0).expired(99.0, [], lambda _: True)


def test_a_send_is_tried_max_send_tries_times() -> None:
    retry = SendRetry()
    assert [retry.failed() for _ in range(MAX_SEND_TRIES)] == [True] * (MAX_SEND_TRIES - 1) + [
        False
    ]
    assert send_timeout_s(10.0) * MAX_SEND_TRIES + 2 * 1.0 <= 2 * 10.0


# ---- whole rounds with slow and dead reducers --------------------------------------------


def _tensor(seed: int) -> torch.Tensor:
    return bf16_values(seed, NUMEL)


def _rounds(size: int) -> dict[str, ShardedRound]:
    return sharded_rounds(IDS[:size], FIELDS, NUMEL, wait_s=WAIT_S, cosign_s=COSIGN_S)


def _simulate(
    size: int, delay: dict[str, float], dead: set[str], detect_s: float, step: float = 0.5
) -> tuple[dict[str, ShardedRound], dict[str, float]]:
    """Pieces all in before the deadline; each member's reduced shards reach the others
    `delay[member]` seconds after it sent them; a dead member sends nothing after its pieces
    and is found lost `detect_s` after the deadline (its shard sends all failed). Returns the
    rounds and when each live member's round ended."""
    rounds = _rounds(size)
    for member in rounds.values():
        for shard, peer in member.piece_sends():
            blob = encode_piece(member.header, member.digests, shard, member.pieces[shard], "bf16")
            rounds[peer].on_piece(decode_piece(blob, NUMEL))
    in_flight: list[tuple[float, str, str, bytes]] = []
    ended: dict[str, float] = {}
    now = WAIT_S
    while now <= WAIT_S + 3 * COSIGN_S:
        for _when, sender, peer, blob in [m for m in in_flight if m[0] <= now]:
            rounds[peer].on_shard(sender, decode_shard(blob, NUMEL))
        in_flight = [m for m in in_flight if m[0] > now]
        for me, member in rounds.items():
            if me in dead or member.done:
                if member.done:
                    ended.setdefault(me, now)
                continue
            if now >= WAIT_S + detect_s:
                for gone in dead:
                    member.on_lost(gone)
            for out in member.tick(now, alive=lambda p: p not in dead):
                blob = out.to_bytes(shard_codec(out.tensor))
                for peer in member.recipients():
                    if peer not in dead:
                        in_flight.append((now + delay.get(me, 0.0), me, peer, blob))
            if member.done:
                ended.setdefault(me, now)
        now += step
    return rounds, ended


def test_a_live_reducer_late_past_the_deadline_no_longer_abandons_the_round() -> None:
    late = IDS[1].peer_id
    rounds, ended = _simulate(4, {late: COSIGN_S + 2.0}, set(), detect_s=99.0)
    outcomes = [r.outcome for r in rounds.values()]
    assert all(isinstance(o, GroupUpdate) and len(o.contributions) == 4 for o in outcomes)
    assert max(ended.values()) <= WAIT_S + 2 * COSIGN_S


def test_a_reducer_later_than_one_extra_window_abandons_it() -> None:
    late = IDS[1].peer_id
    rounds, _ = _simulate(4, {late: 2 * COSIGN_S + 1.0}, set(), detect_s=99.0)
    others = [r.outcome for m, r in rounds.items() if m != late]
    assert all(o == Abandoned("cosign_timeout") for o in others)


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(3, 6),
    delays=st.lists(st.sampled_from([0.0, 0.5, 2.0, 4.0, 6.0, 9.0, 12.0, 99.0]), min_size=6),
    dead_mask=st.lists(st.booleans(), min_size=6, max_size=6),
    detect_s=st.sampled_from([0.5, 3.0, 7.0, 99.0]),
)
def test_a_round_completes_alike_everywhere_or_abandons_by_one_extra_deadline(
    size: int, delays: list[float], dead_mask: list[bool], detect_s: float
) -> None:
    ids = [i.peer_id for i in IDS[:size]]
    dead = {p for p, d in zip(ids, dead_mask, strict=False) if d and p != ids[0]}
    delay = dict(zip(ids, delays, strict=False))
    rounds, ended = _simulate(size, delay, dead, detect_s)
    live = {m: r for m, r in rounds.items() if m not in dead}
    updates = [r.outcome for r in live.values() if isinstance(r.outcome, GroupUpdate)]
    for member, r in live.items():
        assert r.outcome is not None, "every live member's round ends"
        assert ended[member] <= WAIT_S + 2 * COSIGN_S + 0.5  # at most one extra deadline
        assert isinstance(r.outcome, GroupUpdate | Abandoned)
    for update in updates:
        assert update.problem(lambda p: True) is None  # every shard co-signed by its reducer
        assert len(update.contributions) >= rounds[ids[0]].reduction.quorum
        assert update.update_id == updates[0].update_id
        assert [h.author for h in update.contributions] == [
            h.author for h in updates[0].contributions
        ]  # one included set: never two different updates for one round
        assert torch.equal(update.aggregate, updates[0].aggregate)
    slow = [p for p in ids if p not in dead and delay[p] > 0.0]
    if not dead and len(slow) <= 1 and all(delay[p] < 2 * COSIGN_S - 0.5 for p in slow):
        assert len(updates) == len(live), "one slow reducer is survived"


# ---- the exchange: a failed send is tried again before its recipient counts as lost ------


def _exchange(fails: int) -> tuple[GroupExchange, list[str]]:
    me = IDS[0]
    network = SimpleNamespace(identity=me, config=SimpleNamespace(run_id="r"))
    node = GroupExchange(network, numel=NUMEL, reject=lambda *_: None, is_alive=lambda _: True)  # type: ignore[arg-type]
    sent: list[str] = []

    async def send(peer: str, name: str, blob: bytes, timeout_s: float) -> bool:
        sent.append(peer)
        return len(sent) > fails

    node._send = send  # type: ignore[method-assign]
    return node, sent


@pytest.mark.parametrize("fails", [1, MAX_SEND_TRIES - 1, MAX_SEND_TRIES, 2 * MAX_SEND_TRIES])
def test_a_shard_send_is_tried_again_while_the_round_lasts_and_never_makes_its_peer_lost(
    fails: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session 18: under load a live member's streams fail for seconds; a sender that retried
    without it alone split the round. A dead member is lost by the live view instead."""
    monkeypatch.setattr(group_exchange_shards, "RESEND_AFTER_S", 0.0)
    rounds = _rounds(3)
    member = rounds[IDS[0].peer_id]
    for other in list(rounds.values())[1:]:
        for shard, peer in other.piece_sends():
            if peer == member.me:
                blob = encode_piece(other.header, other.digests, shard, other.pieces[shard], "bf16")
                member.on_piece(decode_piece(blob, NUMEL))
    member.tick(WAIT_S)
    member.clock.deadline = time.monotonic() + 60.0  # the round still runs
    node, sent = _exchange(fails)
    peer = IDS[1].peer_id
    asyncio.run(node._send_shard(member, peer, b"x", COSIGN_S))
    assert len(sent) == fails + 1  # until it got through
    assert peer in member.reduction.included
    member.clock.deadline = 0.0  # the round is over: one try, then no more
    node, sent = _exchange(fails)
    asyncio.run(node._send_shard(member, peer, b"x", COSIGN_S))
    assert len(sent) == 1 and peer in member.reduction.included


def test_without_a_deadline_a_send_is_tried_max_send_tries_times() -> None:
    retry = SendRetry()
    assert [retry.failed(5.0, until=10.0), retry.failed(9.5, until=10.0)] == [True, False]
