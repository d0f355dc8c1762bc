"""The shard fetch's pure decisions and messages (merge.shard_fetch, dht.shard_fetch_wire;
docs/scale.md, Session 17): every member composes the same round whatever order the
proposals came in, or falls back; a slice cut from the shards that overlap it is the update's
slice; members that fetch slices through the wire forms end where applying the updates one by
one does; a message tampered, oversized, unsigned or out of bounds is a counted refusal."""

from __future__ import annotations

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
from merge.group_plan import shard_bounds
from merge.identity import Identity
from merge.shard_fetch import (
    MAX_CANDIDATES,
    Proposal,
    compose,
    cut_slice,
    incoming_of_headers,
    pieces_problem,
    variant_digest,
    wanted_shards,
)
from merge.shard_member import MemberRound
from merge.shard_round import ShardRound
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
    numel=st.integers(1, 300),
    shards=st.integers(1, 9),
    members=st.integers(1, 9),
    rank=st.integers(0, 8),
)
def test_a_slice_cut_from_the_shards_that_overlap_it_is_the_updates_slice(
    numel, shards, members, rank
) -> None:
    whole = torch.randn(numel)
    start, end = shard_bounds(numel, members)[rank % members]
    bounds = shard_bounds(numel, shards)
    wanted = wanted_shards(shards, numel, start, end)
    pieces = {k: whole[bounds[k][0] : bounds[k][1]] for k in wanted}
    assert torch.equal(cut_slice(shards, numel, pieces, start, end), whole[start:end])
    fetched = sum(bounds[k][1] - bounds[k][0] for k in wanted)
    assert fetched >= end - start  # whole shards: at least the slice, never a shard too many
    assert all(bounds[k][0] < end and start < bounds[k][1] for k in wanted)


def _slices_through_the_wire(member: MemberRound, updates: list) -> list:
    """What `dht.group_exchange_slices` does for one member: ask, decode, check, cut."""
    start, end = member.slice
    headers = []
    for update in sorted(updates, key=lambda u: (u.head.group_key, u.seq)):
        uid = (update.head.group_key, update.seq)
        got_uid, s, e = parse_slice_request(slice_request(uid, start, end), NUMEL)
        fetched, pieces = decode_slice(slice_answer(update, s, e), NUMEL)
        assert got_uid == uid and fetched.header_problem(_everyone) is None
        assert pieces_problem(fetched, pieces, NUMEL) is None
        headers.append((fetched, cut_slice(fetched.num_shards, NUMEL, pieces, start, end)))
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


def test_a_changed_shard_or_a_wrong_index_is_refused() -> None:
    _, _, updates = _setup(fold=False)
    update = updates[0]
    fetched, pieces = decode_slice(slice_answer(update, 0, NUMEL), NUMEL)
    changed = {k: p + 1e-3 for k, p in pieces.items()}
    assert pieces_problem(fetched, changed, NUMEL) == "shard_mismatch"
    assert pieces_problem(fetched, {5: pieces[0]}, NUMEL) == "shard_index"
    assert pieces_problem(fetched, {0: pieces[0][:-1]}, NUMEL) == "shard_size"


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
        assert torch.equal(torch.cat([pieces[k] for k in sorted(pieces)]), source.aggregate)
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
    assert back.verified() and proposal_of(back) == Proposal(BASE, {("groups.0b1", 3): ("h",)})
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


def test_a_part_must_name_one_variant_per_update() -> None:
    body = {"gram": [[1.0]], "variants": ["a" * 64]}
    assert part_of(_message("part", body), 1) == ([[1.0]], ["a" * 64])
    with pytest.raises(GroupMessageError):
        part_of(_message("part", body), 2)
    with pytest.raises(GroupMessageError):
        parse_slice_request(slice_request(("groups.0b1", 1), 5, 5), NUMEL)
