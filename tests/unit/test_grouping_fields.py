"""A group update's fields on the wire (dht/grouping_fields.py): the compact form rebuilds
exactly the headers their authors signed (their signatures verify) and the same update; the
session 26 form is still read; an update the compact form cannot carry travels in the full
form; hostile fields are a counted GroupMessageError, never another exception; and the
compact form is a fraction of the full one."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping_fields import (
    MAX_FIELDS_BYTES,
    compact_meta,
    full_meta,
    update_meta,
    update_of_meta,
)
from dht.grouping_wire import (
    MAX_COUNT,
    MAX_MEMBERS,
    GroupMessageError,
    decode_update,
    encode_update,
)
from dht.shard_fetch_wire import decode_slice, slice_answer
from merge.group_chunks import aligned_bounds
from merge.group_shards import ShardedReduction, sharded_contribution
from merge.group_update import ContributionHeader, GroupUpdate, RoundFields, tensor_digest
from merge.identity import Identity
from merge.shard_fetch import slice_pieces_problem

POOL = sorted((Identity.generate() for _ in range(64)), key=lambda i: i.peer_id)
RUN = "run-fields"
KEY = "groups.0b10110"


def _header(identity: Identity, k: int, **fields: Any) -> ContributionHeader:
    values: dict[str, Any] = {
        "run_id": RUN,
        "group_key": KEY,
        "epoch": 3,
        "round": 117,
        "learners": 1000,
        "base_applied": 12_000 + k,
        "published_applied": 12_003 + k,
        "tokens": 65_536,
        "norm": 0.1234567 * (k + 1),
        "digest": tensor_digest(torch.full((4,), float(k))),
    }
    values.update(fields)
    return ContributionHeader(author=identity.peer_id, **values).signed(identity)


def _update(g: int, *, members: int = 0, **fields: Any) -> GroupUpdate:
    """g signed headers; `members`: a listed member list of that many (reduce-scatter)."""
    headers = tuple(_header(i, k, **fields) for k, i in enumerate(POOL[:g]))
    listed = tuple(i.peer_id for i in POOL[:members])
    shards = members or g
    digests = tuple(tensor_digest(torch.full((2,), float(j))) for j in range(shards))
    cosignatures = tuple(POOL[j % g].sign(d.encode()) for j, d in enumerate(digests))
    return GroupUpdate(headers, digests, cosignatures, torch.empty(0), listed)


def _through(meta: dict[str, object]) -> GroupUpdate:
    return update_of_meta(json.dumps(meta, separators=(",", ":")).encode(), torch.empty(0))


def _assert_same(back: GroupUpdate, update: GroupUpdate) -> None:
    assert back == update
    for got, sent in zip(back.contributions, update.contributions, strict=True):
        assert got.signing_bytes() == sent.signing_bytes() and got.signature == sent.signature
        assert got.verified()


_norms = st.one_of(
    st.floats(0.0, 1e30, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 5e-324, 1e30, 0.1 + 0.2]),
)


@settings(max_examples=60, deadline=None)
@given(
    g=st.integers(1, 12),
    extra=st.integers(0, 4),
    listed=st.sampled_from(["none", "all", "some"]),
    shared=st.tuples(st.text(min_size=1, max_size=128), st.integers(0, MAX_COUNT)),
    own=st.lists(
        st.tuples(st.integers(0, MAX_COUNT), st.integers(0, MAX_COUNT), _norms), min_size=12
    ),
)
def test_the_compact_form_rebuilds_the_signed_headers_and_the_update(
    g: int, extra: int, listed: str, shared: tuple[str, int], own: list
) -> None:
    headers = tuple(
        _header(POOL[k], k, group_key=shared[0], round=shared[1], base_applied=b, tokens=t, norm=n)
        for k, (b, t, n) in enumerate(own[:g])
    )
    members = {"none": (), "all": POOL[: g + extra], "some": POOL[1 : g + extra]}[listed]
    update = GroupUpdate(
        headers,
        tuple(tensor_digest(torch.full((1,), float(j))) for j in range(len(members) or g)),
        tuple(POOL[j].sign(b"x") for j in range(len(members) or g)),
        torch.empty(0),
        tuple(m.peer_id for m in members),
    )
    meta = update_meta(update)
    assert meta == compact_meta(update) and "headers" not in meta
    _assert_same(_through(meta), update)


def test_the_session_26_form_is_still_read() -> None:
    update = _update(3, members=5)
    h = update.contributions[0]
    old = {  # as a session 26 node's update_meta wrote it
        "headers": [
            {
                "run_id": c.run_id,
                "author": c.author,
                "group_key": c.group_key,
                "epoch": c.epoch,
                "round": c.round,
                "learners": c.learners,
                "base_applied": c.base_applied,
                "published_applied": c.published_applied,
                "tokens": c.tokens,
                "norm": c.norm,
                "digest": c.digest,
                "signature": c.signature.hex(),
            }
            for c in update.contributions
        ],
        "digests": list(update.shard_digests),
        "cosignatures": [c.hex() for c in update.cosignatures],
        "members": list(update.members),
    }
    assert old == full_meta(update) and h.verified()
    _assert_same(_through(old), update)


@pytest.mark.parametrize(
    "update",
    [
        GroupUpdate(
            (_header(POOL[0], 0), _header(POOL[1], 1, learners=999)), ("",), (), torch.empty(0)
        ),
        _update(2, digest="ab"),  # not a SHA-256's hex
        _update(2, digest=tensor_digest(torch.ones(1)).upper()),  # hex, not lowercase
        _update(2, norm=1),  # an int norm signs as "1"
    ],
    ids=["headers_disagree", "short_digest", "upper_digest", "int_norm"],
)
def test_an_update_the_compact_form_cannot_rebuild_goes_in_the_full_form(
    update: GroupUpdate,
) -> None:
    assert compact_meta(update) is None
    meta = update_meta(update)
    assert meta == full_meta(update)
    back = _through(meta)
    assert [c.author for c in back.contributions] == [c.author for c in update.contributions]
    assert back.shard_digests == update.shard_digests


def test_a_slice_answer_carries_the_compact_fields_and_every_signature_still_verifies() -> None:
    update = _update(31, members=33)
    update = GroupUpdate(
        update.contributions,
        tuple(tensor_digest(s) for s in torch.tensor_split(torch.arange(66.0), 33)),
        update.cosignatures,
        torch.arange(66.0),
        update.members,
    )
    back, shards = decode_slice(slice_answer(update, 0, 2), 66)
    assert set(shards) == {0}
    assert back == update and all(h.verified() for h in back.contributions)
    assert back.header_problem({m for m in update.members}.__contains__) is None


def _reduced(members: list[Identity], contributors: int, numel: int) -> GroupUpdate:
    """A real reduce-scatter round's update: `contributors` of `members` included."""
    fields = RoundFields(
        run_id=RUN, group_key=KEY, epoch=1, round=3, learners=4, base_applied=5,
        published_applied=6,
    )  # fmt: skip
    view = ShardedReduction(
        group_key=KEY, epoch=1, round=3, members=[m.peer_id for m in members], numel=numel
    )
    for k, member in enumerate(members[:contributors]):
        part = torch.randn(numel, generator=torch.Generator().manual_seed(k))
        view.contribute(*sharded_contribution(part, member, fields, 10, len(members)))
        for j, piece in enumerate(torch.tensor_split(part, len(members))):
            view.take_piece(member.peer_id, j, piece)
    view.close()
    by_id = {m.peer_id: m for m in members}
    for j, reducer in enumerate(view.reducers):
        shard = view.reduce(j)
        view.take_reduced(j, shard, by_id[reducer].sign(view.statement(j, shard)))
    assert isinstance(view.outcome, GroupUpdate)
    return view.outcome


def test_a_real_reduce_scatter_update_passes_every_check_after_the_wire() -> None:
    update = _reduced(POOL[:5], 4, 23)  # one member left out: its shard reduced by another
    assert "round" in update_meta(update) and len(update.members) == 5
    back = decode_update(encode_update(update), 23)
    assert back == update and back.problem(lambda p: True) is None
    for start, end in aligned_bounds(23, 3):  # another group's slices: 3 of 5 shards
        fetched, pieces = decode_slice(slice_answer(update, start, end), 23)
        assert fetched.header_problem(lambda p: True) is None
        assert slice_pieces_problem(fetched, pieces, 23, start, end) is None


@pytest.mark.parametrize("g", [4, 31, 64])
def test_the_compact_fields_are_a_fraction_of_the_full_ones(g: int) -> None:
    update = _update(g, members=g)
    compact = len(json.dumps(update_meta(update), separators=(",", ":")))
    full = len(json.dumps(full_meta(update), separators=(",", ":")))
    members = sum(len(m) + 3 for m in update.members)
    # per member: its counts and norm, its digest and signature, a shard digest and a
    # co-signature in base64 (~290 B); the full form's are ~650 B (session 26)
    assert compact <= members + 300 * g + 250
    assert compact < 0.55 * full


def _compact() -> dict[str, Any]:
    meta = compact_meta(_update(3, members=4))
    assert meta is not None
    return meta


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize(
    "change",
    [
        {"round": ["run", "key", 1, 2]},  # a shared field missing
        {"round": ["run", "key", 1, 2, True]},  # a bool is not a count
        {"round": ["run", "k" * 129, 1, 2, 3]},  # text over MAX_TEXT
        {"round": ["run", "key", -1, 2, 3]},
        {"round": "run"},
        {"authors": [0, 1, 7]},  # an index past the member list
        {"authors": [0, 1, -1]},
        {"authors": [0, 1, 2.0]},
        {"authors": []},
        {"authors": [0] * (MAX_MEMBERS + 1)},
        {"base": [1, 2]},  # a column of another length
        {"tokens": [1, 2, MAX_COUNT + 1]},
        {"norms": [0.1, 0.2, float("nan")]},
        {"norms": [0.1, 0.2, -1.0]},
        {"norms": [0.1, 0.2, "0.3"]},
        {"digests": _b64(bytes(95))},  # a digest short
        {"digests": "not base64!"},
        {"digests": None},
        {"signatures": _b64(bytes(64 * 3 + 1))},
        {"shards": _b64(bytes(31))},
        {"shards": "A" * 100_000},
        {"cosignatures": _b64(bytes(64 * (MAX_MEMBERS + 1)))},
        {"members": ["x"] * (MAX_MEMBERS + 1)},
        {"members": "x"},
        {"extra": 1},
        {"headers": "x"},  # a full form that does not parse
    ],
)
def test_hostile_compact_fields_are_a_counted_refusal(change: dict[str, Any]) -> None:
    meta = _compact() | change
    with pytest.raises(GroupMessageError) as caught:
        _through(meta)
    assert caught.value.reason == "malformed"


@pytest.mark.parametrize(
    "raw",
    [b"[]", b"nope", b"[" * 100_000, b'{"round": 1}', b"x" * (MAX_FIELDS_BYTES + 1), b"\xff"],
)
def test_fields_that_are_not_an_object_within_bounds_are_a_counted_refusal(raw: bytes) -> None:
    with pytest.raises(GroupMessageError):
        update_of_meta(raw, torch.empty(0))


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(key=st.sampled_from(sorted(_compact())), value=_json)
def test_any_value_in_any_field_is_read_or_refused_never_raised(key: str, value: object) -> None:
    meta = _compact() | {key: value}
    try:
        back = _through(meta)
    except GroupMessageError:
        return
    assert len(back.contributions) == 3  # read: the same three headers, maybe others' fields
