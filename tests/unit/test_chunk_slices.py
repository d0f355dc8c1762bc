"""A member's slice of another group's update through the `group-slice` wire (session 27):
on the chunk grid (merge.group_chunks) a member of a group of any size asks for exactly its
slice of an update reduced by a group of any other size, gets exactly those values with the
chunk digests of each shard they lie in, and checks each piece against its reducer's
co-signed root; a tampered value or digest list is refused, and a session 26 peer's message
is refused as "old_version"."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping_shards import decode_piece, encode_piece
from dht.grouping_wire import GroupMessageError
from dht.shard_fetch_wire import (
    decode_slice,
    parse_slice_request,
    slice_answer,
    slice_request,
)
from merge.group_chunks import aligned_bounds, chunk_size, split
from merge.group_shards import ShardedReduction, sharded_contribution
from merge.group_update import GroupUpdate, RoundFields
from merge.identity import Identity
from merge.shard_fetch import joined_slice, member_slice, slice_pieces_problem

IDS = sorted((Identity.generate() for _ in range(9)), key=lambda i: i.peer_id)
BY_ID = {i.peer_id: i for i in IDS}
FIELDS = RoundFields(
    run_id="r", group_key="groups.0b1", epoch=1, round=3, learners=2, base_applied=5,
    published_applied=6,
)  # fmt: skip
UID = ("groups.0b1", 4)


def _everyone(_: str) -> bool:
    return True


def _update(numel: int, size: int, seed: int = 0) -> GroupUpdate:
    """A complete group update of `size` members by reduce-scatter, every shard co-signed."""
    members = IDS[:size]
    view = ShardedReduction(
        group_key=FIELDS.group_key, epoch=1, round=3, members=[m.peer_id for m in members],
        numel=numel,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for ident in members:
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
    assert view.outcome.problem(_everyone) is None
    return view.outcome


def _ask(update: GroupUpdate, start: int, end: int) -> tuple[GroupUpdate, dict, int]:
    """What dht.group_exchange_slices does: ask, the holder answers, decode; and the number
    of values the answer carried."""
    numel = update.aggregate.numel()
    uid, s, e = parse_slice_request(slice_request(UID, start, end), numel)
    assert (uid, s, e) == (UID, start, end)
    fetched, pieces = decode_slice(slice_answer(update, s, e), numel)
    assert fetched.header_problem(_everyone) is None
    return fetched, dict(pieces), sum(p.numel() for _, p in pieces.values())


@settings(max_examples=40, deadline=None)
@given(
    numel=st.one_of(st.integers(0, 600), st.integers(20_000, 300_000)),
    theirs=st.integers(1, 9),
    ours=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_a_slice_of_any_group_size_is_fetched_exactly_and_verified(
    numel: int, theirs: int, ours: int, seed: int
) -> None:
    """A member of a group of `ours` asks for its slice of an update a group of `theirs`
    reduced: the answer carries exactly its slice's values (never a shard it cuts, whole),
    and every piece checks against its shard's co-signed chunk root."""
    update = _update(numel, theirs, seed)
    names = [f"m{k:02d}" for k in range(ours)]
    for me in names:
        start, end = member_slice(numel, names, me)
        fetched, pieces, carried = _ask(update, start, end)
        assert carried == end - start  # exactly the slice
        assert slice_pieces_problem(fetched, pieces, numel, start, end) is None
        assert torch.equal(joined_slice(pieces), update.aggregate[start:end])


def test_a_tampered_chunk_or_digest_list_is_refused() -> None:
    """One value changed on the way, or a digest list that is not the co-signed one."""
    update = _update(100_000, 3)
    assert chunk_size(100_000) == 390
    names = [f"m{k}" for k in range(4)]
    start, end = member_slice(100_000, names, "m1")  # meets shards 0 and 1 of 3
    fetched, pieces, _ = _ask(update, start, end)
    assert sorted(pieces) == [0, 1]
    digests, piece = pieces[1]
    bad = piece.clone()
    bad[-1] += 1e-3
    assert slice_pieces_problem(fetched, {**pieces, 1: (digests, bad)}, 100_000, start, end) == (
        "chunk_mismatch"
    )
    swapped = (digests[1], digests[0], *digests[2:])
    assert slice_pieces_problem(fetched, {**pieces, 1: (swapped, piece)}, 100_000, start, end) == (
        "chunk_root_mismatch"
    )
    shifted = (digests, update.aggregate[start + 390 : end + 390][: piece.numel()])
    assert slice_pieces_problem(fetched, {**pieces, 1: shifted}, 100_000, start, end) == (
        "chunk_mismatch"
    )


def test_an_empty_or_short_model_splits_and_fetches() -> None:
    """Fewer values than members: some shards and slices are empty, and still check (an
    empty slice is asked for the update's fields alone)."""
    for numel, theirs, ours in ((0, 2, 3), (3, 5, 8), (7, 9, 2), (300, 9, 12)):
        update = _update(numel, theirs)
        names = [f"m{k:02d}" for k in range(ours)]
        for me in names:
            start, end = member_slice(numel, names, me)
            fetched, pieces, carried = _ask(update, start, end)
            assert carried == end - start
            assert slice_pieces_problem(fetched, pieces, numel, start, end) is None
        assert [b - a for a, b in aligned_bounds(numel, theirs)].count(0) == max(0, theirs - numel)


def test_a_request_off_the_chunk_grid_is_refused() -> None:
    numel = 100_000  # chunks of 390
    with pytest.raises(GroupMessageError, match="chunk grid"):
        parse_slice_request(slice_request(UID, 1, 390), numel)
    assert parse_slice_request(slice_request(UID, 390, 780), numel) == (UID, 390, 780)
    assert parse_slice_request(slice_request(UID, 99_840, numel), numel)[1:] == (99_840, numel)


def test_a_session_26_peers_messages_are_refused_as_old_version() -> None:
    """Its slice request (no version), slice answer (DSS1) and group piece (DGP3): refused
    with one clear reason, never a digest check that fails."""
    update = _update(1000, 2)
    old_request = json.dumps({"key": UID[0], "seq": UID[1], "start": 0, "end": 10}).encode()
    answer = slice_answer(update, 0, 1000)
    header, digests = sharded_contribution(torch.ones(1000), IDS[0], FIELDS, 10, 2)
    piece = encode_piece(header, digests, 0, split(torch.ones(1000), 2)[0], "fp32")
    assert decode_piece(piece, 1000).shard == 0
    for decode in (
        lambda: parse_slice_request(old_request, 1000),
        lambda: decode_slice(b"DSS1" + answer[4:], 1000),
        lambda: decode_piece(b"DGP3" + piece[4:], 1000),
    ):
        with pytest.raises(GroupMessageError) as caught:
            decode()
        assert caught.value.reason == "old_version"


def test_an_answer_with_more_digests_than_the_model_has_chunks_is_refused() -> None:
    update = _update(1000, 2)
    blob = slice_answer(update, 0, 1000)
    (length,) = struct.unpack(">I", blob[4:8])
    meta = json.loads(blob[8 : 8 + length])
    meta["digests"][0] = meta["digests"][0] * 3
    raw = json.dumps(meta, separators=(",", ":")).encode()
    with pytest.raises(GroupMessageError, match="chunk digests"):
        decode_slice(blob[:4] + struct.pack(">I", len(raw)) + raw + blob[8 + length :], 1000)


@pytest.mark.parametrize("g", [3, 4, 5, 7])
def test_the_simulator_counts_a_slice_answer_as_the_real_encoder_cuts_it(g: int) -> None:
    """bench.scale_sim_wire's count of one member's answer (the update's fields, exactly its
    slice, each met shard's index, length and chunk digests) is the real answer's length."""
    from bench import scale_sim_wire as wire
    from merge.codecs import get_codec

    numel = 100_000
    update = _update(numel, 4)
    fp32 = get_codec("fp32")  # the aggregate's values are not bf16 ones
    for rank, (start, end) in enumerate(aligned_bounds(numel, g)):
        real = len(slice_answer(update, start, end))
        counted = wire.slice_meta(update) + wire.slice_payload(fp32, numel, 4, g, rank)
        assert counted == real
        assert wire.slice_values(numel, g, rank) == end - start
