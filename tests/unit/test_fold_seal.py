"""A folded reduce-scatter round (dht.grouping_shards with `fold`, docs/scale.md Session 29):
each reduced shard's values go to its replica holder, a seal (`DGS4`: digest and co-signature,
no values) to the others; the round completes on co-signatures, each member holding the shards
merge.shard_holders says it holds, all checked against their co-signed digests. Untrusted
seals are refused with a counted reason; a round not folded refuses a seal."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping_shards import (
    SEAL_MAGIC,
    SHARD_MAGIC,
    ReducedShard,
    ShardedRound,
    decode_piece,
    decode_shard,
    encode_piece,
    shard_codec,
)
from dht.grouping_wire import GroupMessageError
from merge.group_shards import sharded_contribution
from merge.group_update import GroupUpdate, Phase, RoundFields
from merge.identity import Identity
from merge.shard_holders import ShardHolding, held_shards, shard_holders
from tests.factories import bf16_values

IDS = sorted((Identity.generate() for _ in range(6)), key=lambda i: i.peer_id)
FIELDS = RoundFields(
    run_id="r", group_key="groups.0b", epoch=0, round=2, learners=1,
    base_applied=0, published_applied=0,
)  # fmt: skip
NUMEL = 37


def _rounds(size: int, fold: bool) -> dict[str, ShardedRound]:
    ids = IDS[:size]
    members = [i.peer_id for i in ids]
    rounds = {}
    for k, ident in enumerate(ids):
        part = bf16_values(k, NUMEL)
        header, digests = sharded_contribution(part, ident, FIELDS, 10, size)
        rounds[ident.peer_id] = ShardedRound(
            ident, header, digests, part, members, opened_at=0.0, wait_s=5.0,
            cosign_s=5.0, fold=fold,
        )  # fmt: skip
    return rounds


def _pieces_in(size: int, fold: bool = True) -> dict[str, ShardedRound]:
    """`size` members' rounds with every piece sent before the deadline delivered."""
    rounds = _rounds(size, fold=fold)
    for member in rounds.values():
        for shard, peer in member.piece_sends():
            blob = encode_piece(member.header, member.digests, shard, member.pieces[shard], "bf16")
            rounds[peer].on_piece(decode_piece(blob, NUMEL))
    return rounds


def _run(rounds: dict[str, ShardedRound], dead: set[str], now: float) -> list[bytes]:
    """Pieces and reduced shards through their wire forms, as dht.group_exchange_shards sends
    them (folded: values to the replica holder, a seal to the others); the magics sent."""
    sent: list[bytes] = []
    waiting: list[tuple[str, ReducedShard, str]] = []  # values not yet held: sent again
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
            for out in member.tick(now, alive=lambda p: p not in dead):
                assert out.tensor is not None and out.digest is not None
                holder = member.replica_holder(out.shard) if member.reduction.fold else None
                if holder is not None:  # the values first; the seals once the holder has them
                    sent.append(SHARD_MAGIC)
                    waiting.append((me, out, holder))
                    continue
                for peer in member.recipients():
                    sent.append(SHARD_MAGIC)
                    if peer not in dead:
                        blob = out.to_bytes(shard_codec(out.tensor))
                        assert rounds[peer].on_shard(me, decode_shard(blob, NUMEL))
            for gone in dead:
                member.on_lost(gone)
        for me, out, holder in list(waiting):  # dht.group_exchange_shards `_send_folded`
            assert out.tensor is not None and out.digest is not None
            member = rounds[me]
            if holder in dead or member.done or member.reduction.included != out.included:
                waiting.remove((me, out, holder))
                continue
            wire = decode_shard(out.to_bytes(shard_codec(out.tensor)), NUMEL)
            rounds[holder].on_shard(me, wire)
            if not rounds[holder].holds(wire):
                continue
            waiting.remove((me, out, holder))
            assert member.replica_took(out)
            for peer in member.recipients():
                if peer != holder:
                    sent.append(SEAL_MAGIC)
                    seal = decode_shard(out.seal_bytes(out.digest), NUMEL)
                    if peer not in dead:
                        assert rounds[peer].on_shard(me, seal)
    return sent


def _whole(size: int) -> GroupUpdate:
    rounds = _rounds(size, fold=False)
    _run(rounds, set(), now=1.0)
    outcome = next(iter(rounds.values())).outcome
    assert isinstance(outcome, GroupUpdate)
    return outcome


@settings(max_examples=25, deadline=None)
@given(size=st.integers(2, 6))
def test_a_folded_round_completes_on_seals_each_member_holding_its_shards(size: int) -> None:
    rounds = _rounds(size, fold=True)
    sent = _run(rounds, set(), now=1.0)
    whole = _whole(size)
    assert sent.count(SHARD_MAGIC) == size  # each shard's values to one member
    assert sent.count(SEAL_MAGIC) == size * (size - 2)
    bounds = whole.shard_bounds(NUMEL)
    for me, member in rounds.items():
        holding = member.outcome
        assert isinstance(holding, ShardHolding)
        assert holding.fields.aggregate.numel() == 0
        assert holding.fields.shard_digests == whole.shard_digests
        assert holding.fields.cosignatures == whole.cosignatures
        assert set(holding.shards) == set(held_shards(whole, me))
        for k, values in holding.shards.items():
            assert me in shard_holders(whole, k)
            assert torch.equal(values, whole.aggregate[slice(*bounds[k])])
        ShardHolding.of_shards(holding.fields, NUMEL, holding.shards)  # each one checked


def test_a_member_lost_before_its_shards_the_folded_round_retries_without_it() -> None:
    rounds = _pieces_in(4)  # pieces out before the deadline
    gone = IDS[1].peer_id
    _run(rounds, {gone}, now=6.0)
    live = [r.outcome for m, r in rounds.items() if m != gone]
    assert all(isinstance(o, ShardHolding) for o in live)
    fields = [o.fields for o in live if isinstance(o, ShardHolding)]
    assert all(gone not in [h.author for h in f.contributions] for f in fields)
    assert len({f.shard_digests for f in fields}) == 1
    held = set().union(*(o.shards for o in live if isinstance(o, ShardHolding)))
    assert held == set(range(fields[0].num_shards))  # every shard held by a live member


def test_a_reducer_counts_its_folded_shard_only_once_its_replica_holder_has_it() -> None:
    """Session 30: the reducer's own shard is not in, and the round does not complete, until
    its replica holder said it holds the values (`replica_took`); a stale attempt's answer is
    not taken."""
    rounds = _pieces_in(3)
    me = IDS[0].peer_id
    (out,) = rounds[me].tick(1.0)
    assert out.shard in rounds[me].reduction.missing_shards()
    holder = rounds[me].replica_holder(out.shard)
    assert holder is not None
    stale = dataclasses.replace(out, included=out.included[:2])
    assert not rounds[me].replica_took(stale)
    rounds[holder].tick(1.0)
    wire = decode_shard(out.to_bytes(shard_codec(out.tensor)), NUMEL)
    assert not rounds[holder].holds(wire)  # not yet handed to it
    assert rounds[holder].on_shard(me, wire) and rounds[holder].holds(wire)
    assert rounds[me].replica_took(out)
    assert out.shard not in rounds[me].reduction.missing_shards()
    assert not rounds[me].replica_took(out)  # once


def test_a_reducer_waiting_for_its_holder_never_counts_itself_lost() -> None:
    """Its own shard missing past the co-sign deadline (its replica holder has not answered
    yet): a node's live view holds its peers only, and the round once retried without the
    member itself or abandoned at the first deadline (session 30's first runs: rounds ending
    `cosign_timeout` at every member). It waits the one extra window, as for any live
    reducer, with its included set unchanged."""
    rounds = _pieces_in(3)
    me = IDS[0].peer_id
    for peer, other in rounds.items():  # every shard but this member's in, everywhere
        for out in other.tick(1.0):
            if peer == me:
                continue
            holder = other.replica_holder(out.shard)
            assert holder is not None and out.digest is not None
            rounds[holder].on_shard(peer, decode_shard(out.to_bytes("fp32"), NUMEL))
            assert other.replica_took(out)
            seal = decode_shard(out.seal_bytes(out.digest), NUMEL)
            for target in other.recipients():
                if target != holder:
                    rounds[target].on_shard(peer, seal)
    member = rounds[me]
    included = member.reduction.included
    assert member.missing_reducers() == [me]
    view = lambda p: p != me  # noqa: E731 - the node's live view: its peers, not itself
    first = member.cosign_deadline
    member.tick(first + 0.1, alive=view)
    assert member.phase is Phase.REDUCING and member.reduction.included == included
    assert me in member.missing_reducers()
    assert member.cosign_deadline > first  # the one extra window


def _a_seal(fold: bool = True) -> tuple[dict[str, ShardedRound], str, bytes]:
    """A 3-member round after its pieces, with a seal of member 0's shard 0 for the member
    that does not hold its values (folded)."""
    rounds = _pieces_in(3, fold=fold)
    me = IDS[0].peer_id
    (out,) = rounds[me].tick(1.0)
    assert out.digest is not None
    target = next(p for p in rounds[me].recipients() if p != rounds[me].replica_holder(out.shard))
    return rounds, target, out.seal_bytes(out.digest)


def test_a_seal_over_another_digest_or_to_a_round_not_folded_is_refused_and_counted() -> None:
    rounds, target, seal = _a_seal()
    rounds[target].tick(1.0)  # closed: a seal is checked against this included set
    wire = decode_shard(seal, NUMEL)
    assert wire.tensor is None and wire.digest is not None
    other = dataclasses.replace(wire, digest="0" * 64)
    assert not rounds[target].on_shard(IDS[0].peer_id, other)
    assert rounds[target].reduction.rejected == {"bad_cosignature": 1}
    assert rounds[target].on_shard(IDS[0].peer_id, wire)
    plains, _, _ = _a_seal(fold=False)
    plain = plains[target]
    plain.tick(1.0)
    assert not plain.on_shard(IDS[0].peer_id, wire)
    assert plain.reduction.rejected == {"seal_not_folded": 1}


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b + b"x",  # values after a seal
        lambda b: b.replace(b'"digest":"', b'"digest":"zz', 1),
        lambda b: b.replace(b'"digest"', b'"digesT"', 1),
        lambda b: b[:-3],
    ],
)
def test_a_damaged_seal_is_malformed(damage) -> None:  # type: ignore[no-untyped-def]
    _, _, seal = _a_seal()
    with pytest.raises(GroupMessageError) as err:
        decode_shard(damage(seal), NUMEL)
    assert err.value.reason == "malformed"
