"""Shard holders of a group update (docs/scale.md, Session 28; merge.shard_holders,
dht.shard_fetch_slices): who holds each shard is derived from the update's co-signed fields
(reducer, then the next included member), a holder of some shards answers the ranges they
cover, with the update's fields or, when the asker names their variant, without them, and a
whole update is assembled from its shards' holders with every shard checked against its
reducer's co-signed chunk root."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.scale_sim_levers import SHARDS_ONLY, shards_only_framing
from bench.scale_sim_levers import shard_holders as sim_holders
from dht.grouping_wire import GroupMessageError
from dht.shard_fetch_slices import (
    BARE_SLICE_MAGIC,
    decode_slice_answer,
    holding_answer,
    parse_slice_ask,
    slice_ask,
)
from dht.shard_fetch_wire import SLICE_MAGIC, parse_slice_request, slice_answer
from merge.group_chunks import split
from merge.group_shards import ShardedReduction, sharded_contribution
from merge.group_update import GroupUpdate, RoundFields
from merge.identity import Identity
from merge.shard_fetch import joined_slice, slice_pieces_problem, variant_digest
from merge.shard_holders import (
    ShardAssembly,
    ShardHolding,
    fields_of,
    held_shards,
    shard_holders,
)

IDS = sorted((Identity.generate() for _ in range(8)), key=lambda i: i.peer_id)
BY_ID = {i.peer_id: i for i in IDS}
FIELDS = RoundFields(
    run_id="r", group_key="groups.0b1", epoch=1, round=3, learners=2, base_applied=5,
    published_applied=6,
)  # fmt: skip
UID = ("groups.0b1", 4)


def _everyone(_: str) -> bool:
    return True


def _update(numel: int, size: int, included: int | None = None, seed: int = 0) -> GroupUpdate:
    """A complete reduce-scatter update of a list of `size` members, the first `included` of
    them (at least a quorum, half) contributing (the others dropped: their shards reduced by
    an included member)."""
    members = IDS[:size]
    view = ShardedReduction(
        group_key=FIELDS.group_key, epoch=1, round=3, members=[m.peer_id for m in members],
        numel=numel,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for ident in members[: max(included or size, (size + 1) // 2)]:  # at least a quorum
        part = torch.randn(numel, generator=gen)
        header, digests = sharded_contribution(part, ident, FIELDS, 10, size)
        assert view.contribute(header, digests)
        for j, piece in enumerate(split(part, size)):
            assert view.take_piece(ident.peer_id, j, piece)
    view.close()
    for j, reducer in enumerate(view.reducers):
        shard = view.reduce(j)
        assert view.take_reduced(j, shard, BY_ID[reducer].sign(view.statement(j, shard)))
    assert isinstance(view.outcome, GroupUpdate), view.rejected
    return view.outcome


def _holding(update: GroupUpdate, peer: str, replicas: int = 2) -> ShardHolding:
    numel = update.aggregate.numel()
    bounds = update.shard_bounds(numel)
    shards = {k: update.aggregate[a:b] for k, (a, b) in enumerate(bounds)}
    held = {k: shards[k] for k in held_shards(update, peer, replicas)}
    return ShardHolding.of_shards(fields_of(update), numel, held)


@settings(max_examples=40, deadline=None)
@given(size=st.integers(1, 8), dropped=st.integers(0, 7), replicas=st.integers(1, 3))
def test_each_shard_is_held_by_its_reducer_and_the_next_included_members(
    size: int, dropped: int, replicas: int
) -> None:
    update = fields_of(_update(64, size, size - dropped))
    included = len(update.contributions)
    authors = sorted(h.author for h in update.contributions)
    reducers = update.reducers()
    count = {a: 0 for a in authors}
    for k in range(update.num_shards):
        holders = shard_holders(update, k, replicas)
        assert holders[0] == reducers[k]
        assert len(set(holders)) == len(holders) == min(replicas, included)
        assert set(holders) <= set(authors)  # a dropped member holds nothing
        at = authors.index(reducers[k])
        assert list(holders) == [authors[(at + j) % included] for j in range(len(holders))]
        for h in holders:
            count[h] += 1
            assert k in held_shards(update, h, replicas)
    assert sum(count.values()) == update.num_shards * min(replicas, included)
    with pytest.raises(ValueError):
        shard_holders(update, 0, 0)


def test_a_whole_holders_answer_is_session_27s_answer_bit_for_bit() -> None:
    update = _update(1000, 4)
    whole = ShardHolding.of_whole(update)
    for start, end in ((0, 1000), (0, 0), (252, 504), (0, 504)):
        assert holding_answer(whole, UID, start, end) == slice_answer(update, start, end)


@settings(max_examples=25, deadline=None)
@given(size=st.integers(2, 6), dropped=st.integers(0, 4), data=st.data())
def test_a_shard_holder_serves_what_its_shards_cover_with_fields_or_without(
    size: int, dropped: int, data: st.DataObject
) -> None:
    numel = 1000
    update = _update(numel, size, max(1, size - dropped))
    holder = data.draw(st.sampled_from(sorted(h.author for h in update.contributions)))
    holding = _holding(update, holder)
    bounds = update.shard_bounds(numel)
    k = data.draw(st.sampled_from(held_shards(update, holder)))
    start, end = bounds[k]
    assert holding.covers(start, end)
    missing = [j for j in range(size) if j not in holding.shards and bounds[j][0] < bounds[j][1]]
    for j in missing:
        assert not holding.covers(*bounds[j])
    known = fields_of(update)
    full = holding_answer(holding, UID, start, end)
    bare = holding_answer(holding, UID, start, end, variant_digest(known))
    assert full[:4] == SLICE_MAGIC and bare[:4] == BARE_SLICE_MAGIC
    assert len(bare) < len(full)  # the fields are not sent again
    for blob, asker_has in ((full, None), (bare, known)):
        fetched, pieces = decode_slice_answer(blob, numel, UID, asker_has)
        assert fetched.header_problem(_everyone) is None
        assert slice_pieces_problem(fetched, pieces, numel, start, end) is None
        assert torch.equal(joined_slice(pieces), update.aggregate[start:end])


def test_a_fields_less_answer_is_refused_unless_it_is_for_the_asked_update_and_variant() -> None:
    numel = 1000
    update, other = _update(numel, 4), _update(numel, 4, seed=1)
    holding = ShardHolding.of_whole(update)
    known = fields_of(update)
    bare = holding_answer(holding, UID, 0, 252, variant_digest(known))
    with pytest.raises(GroupMessageError) as exc:
        decode_slice_answer(bare, numel, UID, None)  # not asked without fields
    assert exc.value.reason == "malformed"
    with pytest.raises(GroupMessageError) as exc:
        decode_slice_answer(bare, numel, ("groups.0b1", 5), known)
    assert exc.value.reason == "wrong_update"
    with pytest.raises(GroupMessageError) as exc:
        decode_slice_answer(bare, numel, UID, fields_of(other))
    assert exc.value.reason == "wrong_variant"
    # a holder of another variant than the asker names answers with its own fields
    answer = holding_answer(ShardHolding.of_whole(other), UID, 0, 252, variant_digest(known))
    assert answer[:4] == SLICE_MAGIC
    fetched, _ = decode_slice_answer(answer, numel, UID, known)
    assert variant_digest(fetched) == variant_digest(other)
    # a tampered value fails the co-signed chunk root
    length = struct.unpack(">I", bare[4:8])[0]
    meta = json.loads(bare[8 : 8 + length])
    tail = bytearray(bare[8 + length :])
    tail[0] ^= 0xFF
    _, pieces = decode_slice_answer(bytes(bare[: 8 + length]) + bytes(tail), numel, UID, known)
    assert meta["codec"] in ("fp32", "bf16")
    assert slice_pieces_problem(known, pieces, numel, 0, 252) == "chunk_mismatch"


def test_the_ask_names_a_variant_that_a_session_27_holder_ignores() -> None:
    variant = "ab" * 32
    blob = slice_ask(UID, 0, 252, variant)
    assert parse_slice_ask(blob, 1000) == (UID, 0, 252, variant)
    assert parse_slice_request(blob, 1000) == (UID, 0, 252)  # session 27's parser
    assert parse_slice_ask(slice_ask(UID, 0, 252), 1000) == (UID, 0, 252, None)
    with pytest.raises(GroupMessageError) as exc:
        parse_slice_ask(slice_ask(UID, 0, 252, "xyz"), 1000)
    assert exc.value.reason == "malformed"


@settings(max_examples=25, deadline=None)
@given(
    size=st.integers(2, 7),
    dropped=st.integers(0, 3),
    dead=st.sets(st.integers(0, 6), max_size=3),
    replicas=st.integers(1, 2),
)
def test_a_whole_update_is_assembled_from_live_holders_iff_each_shard_has_one(
    size: int, dropped: int, dead: set[int], replicas: int
) -> None:
    numel = 700
    update = _update(numel, size, max(1, size - dropped))
    authors = sorted(h.author for h in update.contributions)
    gone = {authors[i] for i in dead if i < len(authors)}
    assembly = ShardAssembly(fields_of(update), numel)
    bounds = update.shard_bounds(numel)
    for k in range(update.num_shards):
        for holder in shard_holders(update, k, replicas):
            if holder in gone:
                continue
            (_, piece, digests) = _holding(update, holder, replicas).pieces(*bounds[k])[0]
            assert assembly.take(k, digests, piece) is None
            break
    reachable = all(
        set(shard_holders(update, k, replicas)) - gone for k in range(update.num_shards)
    )
    whole = assembly.whole(_everyone)
    if reachable:
        assert isinstance(whole, GroupUpdate)
        assert torch.equal(whole.aggregate, update.aggregate)  # bit for bit
        assert whole.problem(_everyone) is None
    else:
        assert whole == "shards_missing" and assembly.missing()


def test_an_assembly_refuses_a_shard_its_reducer_did_not_cosign() -> None:
    numel = 1000
    update, other = _update(numel, 4), _update(numel, 4, seed=1)
    assembly = ShardAssembly(fields_of(update), numel)
    bounds = update.shard_bounds(numel)
    (_, piece, digests) = ShardHolding.of_whole(other).pieces(*bounds[1])[0]
    assert assembly.take(1, digests, piece) == "chunk_root_mismatch"
    (_, piece, digests) = ShardHolding.of_whole(update).pieces(*bounds[1])[0]
    tampered = piece.clone()
    tampered[3] += 1.0
    assert assembly.take(1, digests, tampered) == "chunk_mismatch"
    assert assembly.take(1, digests, piece[:-1]) == "shard_size"
    assert assembly.take(9, digests, piece) == "shard_index"
    assert assembly.missing() == [0, 1, 2, 3]
    assert assembly.take(1, digests, piece) is None
    assert assembly.missing() == [0, 2, 3]
    with pytest.raises(ValueError):  # a holder keeps only shards it checked
        ShardHolding.of_shards(fields_of(update), numel, {1: tampered})


def test_the_simulator_counts_a_fields_less_answer_and_the_holders_as_nodes_do() -> None:
    update = _update(1000, 5, 4)
    known = fields_of(update)
    key, seq = "groups.0b01101", 123456
    real = holding_answer(ShardHolding.of_whole(update), (key, seq), 0, 0, variant_digest(known))
    assert real[:4] == BARE_SLICE_MAGIC
    assert shards_only_framing(key, seq) == len(real) == SHARDS_ONLY
    for replicas in (1, 2, 3):
        expected = tuple(shard_holders(update, k, replicas) for k in range(update.num_shards))
        assert sim_holders(update, replicas) == expected


def test_an_update_smaller_than_its_group_has_empty_shards_taken_without_a_holder() -> None:
    numel = 3
    update = _update(numel, 5)
    bounds = update.shard_bounds(numel)
    assert [b - a for a, b in bounds] == [1, 1, 1, 0, 0]
    assembly = ShardAssembly(fields_of(update), numel)
    for k, (a, b) in enumerate(bounds):
        if a == b:
            assert assembly.take(k, (), torch.zeros(0)) is None  # what _assembled does
            continue
        (_, piece, digests) = ShardHolding.of_whole(update).pieces(a, b)[0]
        assert assembly.take(k, digests, piece) is None
    whole = assembly.whole(_everyone)
    assert isinstance(whole, GroupUpdate) and torch.equal(whole.aggregate, update.aggregate)
