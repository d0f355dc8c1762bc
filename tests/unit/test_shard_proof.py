"""Session 28 (digest28): a piece proves its own shard's digest against its author's signed
Merkle root (DGP5), and a reduced shard names its co-signers by a bitmap over the round's
member list (DGS3); damaged proofs and bitmaps are counted refusals, the old forms old_version."""

from __future__ import annotations

import contextlib
import hashlib
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping_header import header_fields
from dht.grouping_shards import (
    ReducedShard,
    ShardedRound,
    WireShard,
    decode_piece,
    decode_shard,
    encode_piece,
    piece_frame_bytes,
    shard_frame_bytes,
)
from dht.grouping_wire import MAX_MEMBERS, GroupMessageError
from merge.codecs import get_codec
from merge.group_shards import sharded_contribution
from merge.group_update import RoundFields
from merge.identity import Identity
from merge.shard_proof import (
    ProofError,
    ShardProof,
    bitmap_of,
    members_of,
    merkle_path,
    merkle_root,
    path_length,
    proven_root,
)
from tests.factories import bf16_values

IDS = [Identity.generate() for _ in range(4)]
MEMBERS = tuple(sorted(i.peer_id for i in IDS))
NUMEL = 300
FIELDS = RoundFields(
    run_id="r",
    group_key="groups.0b",
    epoch=0,
    round=2,
    learners=1,
    base_applied=0,
    published_applied=0,
)


def _digests(count: int, seed: int) -> list[str]:
    return [hashlib.sha256(f"{seed}/{i}".encode()).hexdigest() for i in range(count)]


@settings(max_examples=300, deadline=None)
@given(count=st.integers(1, MAX_MEMBERS), data=st.data())
def test_any_shard_of_any_group_size_proves_its_digest(count: int, data: st.DataObject) -> None:
    digests = _digests(count, data.draw(st.integers(0, 10**6)))
    shard = data.draw(st.integers(0, count - 1))
    path = merkle_path(digests, shard)
    assert len(path) == path_length(shard, count) <= max(1, count - 1).bit_length()
    assert proven_root(digests[shard], shard, count, path) == merkle_root(digests)


@settings(max_examples=300, deadline=None)
@given(count=st.integers(2, MAX_MEMBERS), data=st.data())
def test_any_flipped_character_of_digest_path_or_index_is_refused(
    count: int, data: st.DataObject
) -> None:
    digests = _digests(count, data.draw(st.integers(0, 10**6)))
    shard = data.draw(st.integers(0, count - 1))
    root = merkle_root(digests)
    proof = ShardProof.of(digests, shard)
    where = data.draw(st.sampled_from(["digest", "path", "index", "count"]))
    if where == "digest":
        damaged = ShardProof(shard, count, _flip(proof.digest, data), proof.path)
    elif where == "path" and proof.path:
        at = data.draw(st.integers(0, len(proof.path) - 1))
        path = list(proof.path)
        path[at] = _flip(path[at], data)
        damaged = ShardProof(shard, count, proof.digest, tuple(path))
    elif where == "index":
        other = data.draw(st.integers(-3, count + 3).filter(lambda i: i != shard))
        damaged = ShardProof(other, count, proof.digest, proof.path)
    else:
        other = data.draw(st.integers(0, MAX_MEMBERS + 2).filter(lambda c: c != count))
        damaged = ShardProof(shard, other, proof.digest, proof.path)
    with contextlib.suppress(ProofError):  # refused as unparsable: the same count at the caller
        assert damaged.root() != root


def _flip(hex_text: str, data: st.DataObject) -> str:
    at = data.draw(st.integers(0, len(hex_text) - 1))
    new = data.draw(st.sampled_from("0123456789abcdefAFXZ ").filter(lambda c: c != hex_text[at]))
    return hex_text[:at] + new + hex_text[at + 1 :]


@settings(max_examples=200, deadline=None)
@given(count=st.integers(1, MAX_MEMBERS), data=st.data())
def test_a_bitmap_decodes_to_exactly_the_set_in_member_order(
    count: int, data: st.DataObject
) -> None:
    members = tuple(sorted(f"12D3KooW{i:06d}" for i in range(count)))
    chosen = data.draw(st.sets(st.sampled_from(members), min_size=1))
    bitmap = bitmap_of(chosen, members)
    assert len(bitmap) == 2 * ((count + 7) // 8)
    assert members_of(bitmap, members) == tuple(m for m in members if m in chosen)
    at = data.draw(st.integers(0, len(bitmap) - 1))
    flipped = bitmap[:at] + format(int(bitmap[at], 16) ^ 1, "x") + bitmap[at + 1 :]
    with contextlib.suppress(ProofError):  # a bit past the list, or none left: refused
        assert members_of(flipped, members) != members_of(bitmap, members)
    for bad in (bitmap + "00", bitmap[:-2], bitmap.upper() if bitmap.upper() != bitmap else "g"):
        with pytest.raises(ProofError):
            members_of(bad, members)


def _round(member: Identity) -> ShardedRound:
    part = bf16_values(MEMBERS.index(member.peer_id), NUMEL)
    header, digests = sharded_contribution(part, member, FIELDS, 10, len(MEMBERS))
    return ShardedRound(
        member, header, digests, part, MEMBERS, opened_at=0.0, wait_s=5.0, cosign_s=5.0
    )


def test_a_piece_carries_one_digest_and_its_path_and_is_refused_when_damaged() -> None:
    sender, receiver = _round(IDS[0]), _round(IDS[1])
    shard = MEMBERS.index(receiver.me)
    blob = encode_piece(sender.header, sender.digests, shard, sender.pieces[shard], "bf16")
    meta = json.loads(blob[8 : 8 + int.from_bytes(blob[4:8], "big")])
    assert "digests" not in meta and len(meta["path"]) == path_length(shard, len(MEMBERS))
    assert receiver.on_piece(decode_piece(blob, NUMEL))
    for key, value in (("digest", "0" * 64), ("path", ["1" * 64] * 2), ("shards", 5)):
        raw = json.dumps(dict(meta, **{key: value}), sort_keys=True, separators=(",", ":"))
        tail = blob[8 + int.from_bytes(blob[4:8], "big") :]
        damaged = blob[:4] + len(raw).to_bytes(4, "big") + raw.encode() + tail
        with pytest.raises(GroupMessageError) as refused:
            decode_piece(damaged, NUMEL)
        assert refused.value.reason in {"bad_proof", "bad_signature", "malformed"}


def test_a_reducer_taking_another_shard_over_needs_that_shards_proof() -> None:
    sender, receiver = _round(IDS[0]), _round(IDS[1])
    mine = MEMBERS.index(receiver.me)
    other = (mine + 1) % len(MEMBERS)
    first = encode_piece(sender.header, sender.digests, mine, sender.pieces[mine], "bf16")
    assert receiver.on_piece(decode_piece(first, NUMEL))
    assert receiver.reduction.piece_of(sender.me, other) is None
    assert not receiver.reduction.take_piece(sender.me, other, sender.pieces[other])
    assert receiver.reduction.rejected.get("piece_without_proof") == 1
    later = encode_piece(sender.header, sender.digests, other, sender.pieces[other], "bf16")
    assert receiver.on_piece(decode_piece(later, NUMEL))


def test_the_decoded_co_signer_set_is_what_the_signature_covers() -> None:
    included = MEMBERS[:3]
    shard = ReducedShard("groups.0b", 0, 2, included, 1, b"s" * 64, torch.ones(4), MEMBERS)
    wire = decode_shard(shard.to_bytes("bf16"), NUMEL)
    assert isinstance(wire, WireShard) and wire.bitmap == bitmap_of(included, MEMBERS)
    decoded = wire.over(MEMBERS)
    assert (decoded.included, decoded.members, decoded.signature) == (included, MEMBERS, b"s" * 64)
    assert torch.equal(decoded.tensor, shard.tensor)
    member = _round(IDS[0])
    bad = WireShard("groups.0b", 0, 2, "ff", 1, b"s" * 64, torch.ones(4))  # a bit past 4
    assert not member.on_shard(IDS[1].peer_id, bad)
    assert member.reduction.rejected.get("bad_included") == 1


@pytest.mark.parametrize("magic", [b"DGP4", b"DGP3"])
def test_the_session_27_piece_is_refused_as_old_version(magic: bytes) -> None:
    sender = _round(IDS[0])
    blob = encode_piece(sender.header, sender.digests, 0, sender.pieces[0], "bf16")
    with pytest.raises(GroupMessageError) as refused:
        decode_piece(magic + blob[4:], NUMEL)
    assert refused.value.reason == "old_version"


@pytest.mark.parametrize("magic", [b"DGS2", b"DGS1"])
def test_the_session_27_shard_is_refused_as_old_version(magic: bytes) -> None:
    shard = ReducedShard("groups.0b", 0, 2, MEMBERS, 1, b"s" * 64, torch.ones(4), MEMBERS)
    with pytest.raises(GroupMessageError) as refused:
        decode_shard(magic + shard.to_bytes("bf16")[4:], NUMEL)
    assert refused.value.reason == "old_version"


@pytest.mark.parametrize("codec", ["bf16", "fp32"])
def test_the_frames_the_simulator_counts_are_the_encoders_bytes(codec: str) -> None:
    """bench.scale_sim_reduce counts a piece as its frame, its header and its values, and a
    reduced shard as its frame and its values: exactly what the encoders write."""
    sender = _round(IDS[0])
    header_json = json.dumps(header_fields(sender.header), sort_keys=True, separators=(",", ":"))
    for shard, piece in enumerate(sender.pieces):
        blob = encode_piece(sender.header, sender.digests, shard, piece, codec)
        values = get_codec(codec).payload_bytes(piece.numel())
        frame = piece_frame_bytes(sender.digests, shard, codec)
        assert len(blob) == frame + len(header_json) + values
    for included in (MEMBERS, MEMBERS[1:]):
        shard = ReducedShard("groups.0b", 0, 2, included, 3, b"s" * 64, torch.ones(7), MEMBERS)
        values = get_codec(codec).payload_bytes(7)
        assert len(shard.to_bytes(codec)) == shard_frame_bytes(shard, codec) + values
