"""The shard fetch's pure decisions and messages (merge.shard_fetch, dht.shard_fetch_wire;
docs/scale.md, Session 17): every member composes the same round whatever order the proposals
came in, or falls back; a slice is exactly the pieces of the shards it meets (the chunk grid,
session 27), each checked against its shard's co-signed chunk root; members that fetch slices
through the wire forms end where applying the updates one by one does; a message tampered,
oversized, unsigned or out of bounds is a counted refusal."""

from __future__ import annotations

import base64
import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping_wire import GroupMessageError
from dht.shard_fetch_wire import (
    FetchMessage,
    decode_fetch,
    decode_slice,
    parse_slice_request,
    part_of,
    proposal_body,
    proposal_of,
    slice_answer,
    slice_request,
)
from merge.group_chunks import aligned_bounds
from merge.identity import Identity
from merge.shard_fetch import (
    MAX_CANDIDATES,
    Proposal,
    compose,
    incoming_of_headers,
    joined_slice,
    slice_pieces_problem,
    variant_digest,
    wanted_pieces,
)
from merge.shard_member import MemberRound
from merge.shard_part import variants_digest
from merge.shard_round import ShardRound
from merge.shard_states import states_digest
from tests.unit.shard_round_paths import NUMEL, RUN, _assert_alike, _everyone, _one_by_one
from tests.unit.test_shard_member import MEMBERS, _exchange_parts, _exchange_sums, _setup

ME = Identity.generate()
BASE = (7, "ab" * 32)

ids_st = st.lists(
    st.tuples(st.sampled_from(["groups.0b0", "groups.0b1", "groups.0b10"]), st.integers(1, 9)),
    max_size=8,
    unique=True,
)


@settings(max_examples=60, deadline=None)
@given(per_member=st.lists(ids_st, min_size=1, max_size=5), seed=st.integers(0, 1000))
def test_every_member_composes_the_same_round_whatever_order(per_member, seed) -> None:
    members = [f"peer{i}" for i in range(len(per_member))]
    proposals = {
        m: Proposal(BASE, {uid: (f"holder-{m}",) for uid in ids})
        for m, ids in zip(members, per_member, strict=True)
    }
    shuffled = list(proposals.items())
    random.Random(seed).shuffle(shuffled)
    a, b = compose(proposals, members), compose(dict(shuffled), list(reversed(members)))
    assert a == b and not isinstance(a, str)
    common = set.intersection(*(set(ids) for ids in per_member))
    assert a.ids == tuple(sorted(common))
    for uid in a.ids:  # any member that named it holds it
        assert set(a.holders[uid]) == {f"holder-{m}" for m in members}


def test_a_round_falls_back_on_a_missing_proposal_or_bases_that_differ() -> None:
    one = Proposal(BASE, {("groups.0b1", 3): ("h",)})
    assert compose({"a": one}, ["a", "b"]) == "proposal_missing"
    other = Proposal((8, BASE[1]), {("groups.0b1", 3): ("h",)})
    assert compose({"a": one, "b": other}, ["a", "b"]) == "base_differs"
    many = Proposal(BASE, {("groups.0b1", s): ("h",) for s in range(1, MAX_CANDIDATES + 2)})
    assert compose({"a": one, "b": many}, ["a", "b"]) == "proposal_out_of_bounds"


@settings(max_examples=100, deadline=None)
@given(
    numel=st.integers(1, 3000),
    shards=st.integers(1, 9),
    members=st.integers(1, 9),
    rank=st.integers(0, 8),
)
def test_a_slice_is_exactly_the_pieces_of_the_shards_it_meets(numel, shards, members, rank) -> None:
    """On the chunk grid a member's slice is a run of whole chunks of every shard it meets:
    it fetches exactly its values, never a shard whole (session 27)."""
    whole = torch.randn(numel)
    start, end = aligned_bounds(numel, members)[rank % members]
    bounds = aligned_bounds(numel, shards)
    wanted = wanted_pieces(shards, numel, start, end)
    pieces = {k: ((), whole[a:b]) for k, a, b in wanted}
    assert torch.equal(joined_slice(pieces), whole[start:end])
    assert sum(b - a for _, a, b in wanted) == end - start  # exactly the slice
    assert all(bounds[k][0] <= a < b <= bounds[k][1] for k, a, b in wanted)


def _slices_through_the_wire(member: MemberRound, updates: list) -> list:
    """What `dht.group_exchange_slices` does for one member: ask, decode, check, cut."""
    start, end = member.slice
    headers = []
    for update in sorted(updates, key=lambda u: (u.head.group_key, u.seq)):
        uid = (update.head.group_key, update.seq)
        got_uid, s, e = parse_slice_request(slice_request(uid, start, end), NUMEL)
        fetched, pieces = decode_slice(slice_answer(update, s, e), NUMEL)
        assert got_uid == uid and fetched.header_problem(_everyone) is None
        assert slice_pieces_problem(fetched, pieces, NUMEL, start, end) is None
        headers.append((fetched, joined_slice(pieces)))
    return headers


def test_members_fetching_slices_through_the_wire_end_as_applied_one_by_one() -> None:
    pipelines, reference, updates = _setup(fold=False)
    rounds = []
    for pipeline, me in zip(pipelines, MEMBERS, strict=True):
        probe = MemberRound(ShardRound(pipeline.groups), MEMBERS, me, [])
        fetched = _slices_through_the_wire(probe, updates)
        incoming = [incoming_of_headers(pipeline.groups, u, NUMEL, _everyone) for u, _ in fetched]
        member = MemberRound(ShardRound(pipeline.groups), MEMBERS, me, incoming)
        for index in member.needs():
            assert member.fetched(index, fetched[index][1])
        rounds.append(member)
    _exchange_parts(rounds)
    _exchange_sums(rounds)
    for member in rounds:
        assert member.apply() is not None and member.failed is None
    _one_by_one(reference, updates)
    for pipeline in pipelines:
        _assert_alike(pipeline, reference)
    assert len({variant_digest(u) for u in updates}) == len(updates)


def test_a_changed_piece_digest_list_or_index_is_refused() -> None:
    _, _, updates = _setup(fold=False)
    update = updates[0]
    fetched, pieces = decode_slice(slice_answer(update, 0, NUMEL), NUMEL)

    def check(changed: dict) -> str | None:
        return slice_pieces_problem(fetched, changed, NUMEL, 0, NUMEL)

    assert check(dict(pieces)) is None
    assert check({**pieces, 0: (pieces[0][0], pieces[0][1] + 1e-3)}) == "chunk_mismatch"
    forged = (pieces[0][0][1], *pieces[0][0][1:])
    assert check({**pieces, 0: (forged, pieces[0][1])}) == "chunk_root_mismatch"
    assert check({**pieces, 0: (pieces[0][0], pieces[0][1][:-1])}) == "shard_size"
    assert check({**pieces, 99: pieces[0]}) == "shard_index"
    assert check({k: v for k, v in pieces.items() if k}) == "shards_missing"


def test_bf16_values_travel_in_bf16_exactly_and_others_in_fp32() -> None:
    """A group update of bf16 parts holds bf16 values and a member rounds its sums to bf16:
    both travel in half the bytes of fp32 and arrive exactly; fp32 values stay fp32."""
    _, _, updates = _setup(fold=False)
    update = updates[0]
    narrow = dataclasses.replace(update, aggregate=update.aggregate.bfloat16().float())
    wide_blob, narrow_blob = slice_answer(update, 0, NUMEL), slice_answer(narrow, 0, NUMEL)
    assert len(wide_blob) > 4 * NUMEL and len(narrow_blob) < len(wide_blob) - 2 * NUMEL + 64
    for source, blob in ((update, wide_blob), (narrow, narrow_blob)):
        _, pieces = decode_slice(blob, NUMEL)
        assert torch.equal(joined_slice(pieces), source.aggregate)
    values = torch.randn(NUMEL)
    for tensor, width in ((values.bfloat16().float(), 2), (values, 4)):
        message = _message("sums", {}, [tensor]).signed(ME)
        blob = message.to_bytes()
        back = decode_fetch(blob, NUMEL)
        assert back.verified() and torch.equal(back.tensors[0], tensor)
        assert width * NUMEL <= len(blob) < width * NUMEL + 1024
    bogus = blob.replace(b'"codec":"fp32"', b'"codec":"int8"')
    with pytest.raises(GroupMessageError) as caught:
        decode_fetch(bogus, NUMEL)
    assert caught.value.reason == "malformed"
    short = blob.replace(b'"codec":"fp32"', b'"codec":"bf16"')  # fp32 bytes said to be bf16
    with pytest.raises(GroupMessageError) as caught:
        decode_fetch(short, NUMEL)
    assert caught.value.reason == "wrong_size"


def _message(kind: str = "propose", body: dict | None = None, tensors=()) -> FetchMessage:
    body = proposal_body(Proposal(BASE, {("groups.0b1", 3): ("h",)})) if body is None else body
    return FetchMessage(RUN, ("groups.0b0", 0, 4), kind, ME.peer_id, body, tuple(tensors))


def test_a_signed_message_round_trips_and_a_tampered_one_does_not_verify() -> None:
    message = _message().signed(ME)
    back = decode_fetch(message.to_bytes(), NUMEL)
    sent = Proposal(BASE, {("groups.0b1", 3): ("h",)}, (), states_digest(()))
    assert back.verified() and proposal_of(back) == sent
    forged = FetchMessage(
        back.run_id, back.round_id, back.kind, back.sender,
        proposal_body(Proposal((8, BASE[1]), {})), (), back.signature,
    )  # fmt: skip
    assert not forged.verified()
    sums = _message("sums", {}, [torch.ones(5), torch.zeros(3)]).signed(ME)
    back = decode_fetch(sums.to_bytes(), NUMEL)
    assert back.verified() and [t.tolist() for t in back.tensors] == [[1.0] * 5, [0.0] * 3]
    other = Identity.generate()
    assert not dataclasses.replace(sums, signature=other.sign(sums.statement())).verified()


@pytest.mark.parametrize(
    "blob, reason",
    [
        (b"junk", "malformed"),
        (b"DSF1\xff\xff\xff\xff{}", "malformed"),
        (_message("sums", {}, [torch.tensor([float("nan")])]).signed(ME).to_bytes(), "not_finite"),
        (_message("propose", {}, [torch.ones(2)]).signed(ME).to_bytes(), "malformed"),
        (_message("sums", {}, [torch.ones(NUMEL + 1)]).signed(ME).to_bytes(), "malformed"),
        (_message("gossip").signed(ME).to_bytes(), "malformed"),
    ],
    # the signed blobs hold a generated key: both xdist workers must collect the same ids
    ids=["junk", "huge_header", "nan_sums", "propose_with_tensor", "sums_too_long", "gossip"],
)
def test_a_message_out_of_bounds_is_refused_with_a_reason(blob: bytes, reason: str) -> None:
    with pytest.raises(GroupMessageError) as caught:
        decode_fetch(blob, NUMEL)
    assert caught.value.reason == reason


@pytest.mark.parametrize(
    "body",
    [
        {"base": [1], "ids": []},
        {"base": [-1, "d"], "ids": []},
        {"base": [1, "d"], "ids": [["groups.0b1", 0, ["h"]]]},
        {"base": [1, "d"], "ids": [["groups.0b1", 1, []]]},
        {"base": [1, "d"], "ids": [["groups.0b1", 1, ["h"] * 9]]},
        {"base": [1, "d"], "ids": [["g", s, ["h"]] for s in range(1, MAX_CANDIDATES + 2)]},
    ],
)
def test_a_proposal_out_of_bounds_is_refused(body: dict) -> None:
    with pytest.raises(GroupMessageError):
        proposal_of(_message("propose", body))


def test_a_part_names_its_variants_by_one_digest_and_session_26_parts_are_old() -> None:
    body = {"gram": [[1.0]], "variants": ["a" * 64]}
    with pytest.raises(GroupMessageError, match="sessions 26-28"):
        part_of(_message("part", body))
    raw = bytes.fromhex(variants_digest(["a" * 64]))
    body = {"v": 3, "variants": base64.b64encode(raw).decode()}
    message = _message("part", body, (torch.tensor([1.0]),))
    assert part_of(message) == ([[1.0]], variants_digest(["a" * 64]))
    assert part_of(message)[1] != variants_digest(["a" * 64, "b" * 64])
    with pytest.raises(GroupMessageError):
        parse_slice_request(slice_request(("groups.0b1", 1), 6, 5), NUMEL)
