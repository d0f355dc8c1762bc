"""Reduce-scatter rounds as members run them (dht.grouping_shards): pieces and reduced shards
through their wire forms, members dropping, untrusted bytes refused with a counted reason."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping_shards import (
    ReducedShard,
    ShardedRound,
    decode_piece,
    decode_shard,
    encode_piece,
    shard_codec,
)
from dht.grouping_wire import GroupMessageError, decode_update, encode_update
from merge.group_update import Abandoned, GroupUpdate, Phase, RoundFields
from merge.identity import Identity
from tests.factories import bf16_values, sharded_rounds

IDS = sorted((Identity.generate() for _ in range(6)), key=lambda i: i.peer_id)
FIELDS = RoundFields(
    run_id="r",
    group_key="groups.0b",
    epoch=0,
    round=2,
    learners=1,
    base_applied=0,
    published_applied=0,
)
NUMEL = 37


def _bf16(seed: int) -> torch.Tensor:
    return bf16_values(seed, NUMEL)


def _rounds(size: int) -> dict[str, ShardedRound]:
    return sharded_rounds(IDS[:size], FIELDS, NUMEL, wait_s=5.0, cosign_s=5.0)


def _run(rounds: dict[str, ShardedRound], dead: set[str], now: float) -> None:
    """Every live member's pieces and reduced shards through their wire forms, until quiet."""
    for _ in range(6):
        for me, member in rounds.items():
            if me in dead:
                continue
            for shard, peer in member.piece_sends():
                blob = encode_piece(
                    member.header, member.digests, shard, member.pieces[shard], "bf16"
                )
                if peer not in dead:
                    rounds[peer].on_piece(decode_piece(blob, NUMEL))
        for me, member in rounds.items():
            if me in dead:
                continue
            for out in member.tick(now):
                blob = out.to_bytes(shard_codec(out.tensor))
                for peer in member.recipients():
                    if peer not in dead:
                        rounds[peer].on_shard(me, decode_shard(blob, NUMEL))
            for gone in dead:
                member.on_lost(gone)


def test_every_member_assembles_one_verified_update_through_the_wire() -> None:
    rounds = _rounds(4)
    _run(rounds, set(), now=1.0)  # all in before the deadline: closes early
    outcomes = [r.outcome for r in rounds.values()]
    assert all(isinstance(o, GroupUpdate) for o in outcomes)
    first = outcomes[0]
    assert isinstance(first, GroupUpdate)
    assert all(torch.equal(o.aggregate, first.aggregate) for o in outcomes)  # type: ignore[union-attr]
    mean = torch.stack([_bf16(k) for k in range(4)]).mean(0).to(torch.bfloat16).float()
    assert torch.equal(first.aggregate, mean)
    wire = decode_update(encode_update(first), NUMEL)
    assert wire.members == first.members and wire.problem(lambda p: True) is None


def test_a_reducer_lost_after_the_deadline_the_round_retries_without_it() -> None:
    rounds = _rounds(4)
    gone = IDS[1].peer_id
    for member in rounds.values():  # pieces out before the deadline
        for shard, peer in member.piece_sends():
            blob = encode_piece(member.header, member.digests, shard, member.pieces[shard], "bf16")
            rounds[peer].on_piece(decode_piece(blob, NUMEL))
    _run(rounds, {gone}, now=6.0)
    live = [r.outcome for m, r in rounds.items() if m != gone]
    assert all(isinstance(o, GroupUpdate) for o in live)
    assert all(gone not in [h.author for h in o.contributions] for o in live)  # type: ignore[union-attr]


def test_a_member_that_never_sends_is_left_out_and_its_shard_reduced_by_another() -> None:
    rounds = _rounds(4)
    late = IDS[2].peer_id
    _run(rounds, {late}, now=6.0)
    live = [r.outcome for m, r in rounds.items() if m != late]
    assert all(isinstance(o, GroupUpdate) for o in live)
    update = live[0]
    assert isinstance(update, GroupUpdate) and len(update.contributions) == 3
    assert update.reducers()[2] != late


def test_shards_missing_at_the_cosign_deadline_abandon() -> None:
    rounds = _rounds(3)
    member, other = rounds[IDS[0].peer_id], rounds[IDS[1].peer_id]
    for shard, peer in other.piece_sends():
        if peer == member.me:
            member.on_piece(decode_piece(
                encode_piece(other.header, other.digests, shard, other.pieces[shard], "bf16"),
                NUMEL,
            ))  # fmt: skip
    assert len(member.tick(5.0)) == 1  # closed with two in: its own shard out, the rest due
    assert member.phase is Phase.REDUCING
    member.tick(10.0, alive=lambda peer: peer != other.me)  # a late reducer is dead
    assert member.outcome == Abandoned("cosign_timeout")


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, 10_000), value=st.integers(0, 255))
def test_damaged_pieces_and_shards_are_refused_with_a_reason(position: int, value: int) -> None:
    rounds = _rounds(3)
    member = rounds[IDS[0].peer_id]
    piece = encode_piece(member.header, member.digests, 1, member.pieces[1], "bf16")
    members = tuple(sorted(member.members))
    shard = ReducedShard(
        "groups.0b", 0, 2, (IDS[0].peer_id,), 1, b"s" * 64, member.pieces[1], members
    )
    for blob, decode in ((piece, decode_piece), (shard.to_bytes("bf16"), decode_shard)):
        damaged = bytearray(blob)
        damaged[position % len(blob)] = value
        try:
            decode(bytes(damaged), NUMEL)
        except GroupMessageError as exc:
            assert exc.reason
    with pytest.raises(GroupMessageError):
        decode_piece(piece[:-2], NUMEL)
    with pytest.raises(GroupMessageError):
        decode_piece(b"DGP5" + b"\xff" * 8, NUMEL)
    with pytest.raises(GroupMessageError):
        decode_shard(b"DGS3" + b"\x00\x00\x00\x02{}", NUMEL)
