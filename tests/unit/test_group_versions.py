"""Versions of the whole group update (`group-update`, dht/grouping_wire.py) and of the
`group-done` notice (dht/group_notice.py), session 28. Since session 27 a shard digest is a
chunk root; a session 26 update kept its magic and failed every replica's check as
`shard_mismatch`, counted against an honest old peer as if hostile. Now: the new forms
(`DGU3`/`DGU4`, `DGD3`) round-trip bit for bit with every signature covering what the receiver
uses; session 26's update and sessions 14-27's notice, built here as their encoders built
them, are refused as "old_version" and counted so by the real exchange; session 27's
update (compact fields, chunk roots) is still read; arbitrary bytes never crash a decoder."""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.gossip_groups import parse_fetched
from dht.group_exchange import GroupExchange
from dht.group_notice import NOTICE_MAGIC, SignedDone, decode_notice, notice_refusal
from dht.grouping import member_check, peer_bits
from dht.grouping_done import Done
from dht.grouping_fields import compact_meta, full_meta
from dht.grouping_wire import (
    BF16_UPDATE_MAGIC,
    UPDATE_MAGIC,
    GroupMessageError,
    decode_update,
    encode_update,
    update_max_bytes,
)
from merge.codecs import get_codec
from merge.group_shards import ShardedReduction, sharded_contribution
from merge.group_update import GroupUpdate, RoundFields, tensor_digest
from merge.identity import Identity

RUN = "run-versions"
KEY = "groups.0b0"
NUMEL = 23


def _inside(count: int) -> list[Identity]:
    """Fresh keys inside the group's prefix "0" (the exchange checks membership)."""
    found: list[Identity] = []
    while len(found) < count:
        identity = Identity.generate()
        if peer_bits(RUN, identity.peer_id).startswith("0"):
            found.append(identity)
    return sorted(found, key=lambda i: i.peer_id)


MEMBERS = _inside(5)


def _reduced(contributors: int = 4, *, bf16: bool = False) -> GroupUpdate:
    """A real reduce-scatter round's update on the chunk grid (one member left out)."""
    fields = RoundFields(
        run_id=RUN, group_key=KEY, epoch=1, round=3, learners=4, base_applied=5,
        published_applied=6,
    )  # fmt: skip
    ids = [m.peer_id for m in MEMBERS]
    view = ShardedReduction(group_key=KEY, epoch=1, round=3, members=ids, numel=NUMEL)
    for k, member in enumerate(MEMBERS[:contributors]):
        part = torch.randn(NUMEL, generator=torch.Generator().manual_seed(k))
        if bf16:
            part = part.to(torch.bfloat16).to(torch.float32)
        contribution = sharded_contribution(part, member, fields, 10, len(MEMBERS))
        view.contribute(*contribution)
        for j, (start, end) in enumerate(view.bounds):
            view.take_piece(member.peer_id, j, part[start:end])
    view.close()
    by_id = {m.peer_id: m for m in MEMBERS}
    for j, reducer in enumerate(view.reducers):
        shard = view.reduce(j)
        view.take_reduced(j, shard, by_id[reducer].sign(view.statement(j, shard)))
    assert isinstance(view.outcome, GroupUpdate)
    return view.outcome


def _old_update_bytes(update: GroupUpdate, meta: dict[str, object]) -> bytes:
    """A whole update as sessions 10-27 encoded it (f557798, 0f457c4: `encode_update`):
    DGU2 and bf16 where the aggregate's values all are, else DGU1 and fp32; `meta` is the
    fields (session 26: the full form; session 27: the compact one)."""
    raw = json.dumps(meta, separators=(",", ":")).encode()
    head = struct.pack(">I", len(raw)) + raw
    aggregate = update.aggregate.detach().to(torch.float32).contiguous()
    if torch.equal(aggregate.to(torch.bfloat16).to(torch.float32), aggregate):
        return b"DGU2" + head + get_codec("bf16").encode(aggregate)
    return b"DGU1" + head + aggregate.numpy().astype("<f4").tobytes()


def _session_26(update: GroupUpdate) -> GroupUpdate:
    """The same round as a session 26 node completes it: each shard's digest the hash of its
    values (merge.group_update `tensor_digest`), not a chunk root, co-signed by its reducer."""
    shards = [update.aggregate[s:e] for s, e in update.shard_bounds(NUMEL)]
    digests = tuple(tensor_digest(s.contiguous()) for s in shards)
    return replace(update, shard_digests=digests)


# ---- the new form ----------------------------------------------------------------------------


@pytest.mark.parametrize("bf16", [False, True])
def test_the_new_form_round_trips_bit_for_bit_and_passes_every_check(bf16: bool) -> None:
    update = _reduced(bf16=bf16)
    blob = encode_update(update)
    assert blob[:4] == (BF16_UPDATE_MAGIC if bf16 else UPDATE_MAGIC)
    assert blob[:4] in (b"DGU3", b"DGU4") and len(blob) <= update_max_bytes(NUMEL)
    back = decode_update(blob, NUMEL)
    assert back == update and torch.equal(back.aggregate, update.aggregate)
    assert encode_update(back) == blob  # bit for bit
    # What the receiver uses is what was signed: every header, shard and co-signature checks.
    assert back.problem(lambda _: True) is None
    assert all(h.verified() for h in back.contributions)


def test_a_changed_aggregate_under_the_new_magic_fails_the_co_signed_roots() -> None:
    update = _reduced()
    blob = bytearray(encode_update(update))
    blob[-1] ^= 0x01  # the last value's low byte
    back = decode_update(bytes(blob), NUMEL)
    assert back.problem(lambda _: True) == "shard_mismatch"


# ---- session 26 and 27 updates ----------------------------------------------------------------


def test_a_session_26_update_is_refused_as_old_version_not_as_shard_mismatch() -> None:
    old = _session_26(_reduced())
    blob = _old_update_bytes(old, full_meta(old))
    assert blob[:4] == b"DGU1"
    # What it was before session 28: it decoded, and every replica found its shards wrong.
    assert old.problem(lambda _: True) == "shard_mismatch"
    with pytest.raises(GroupMessageError) as caught:
        decode_update(blob, NUMEL)
    assert caught.value.reason == "old_version"
    assert parse_fetched(blob, (KEY, old.seq), NUMEL) == "group_update_old_version"


def test_a_session_26_bf16_update_is_refused_as_old_version() -> None:
    old = _session_26(_reduced(bf16=True))
    blob = _old_update_bytes(old, full_meta(old))
    assert blob[:4] == b"DGU2"
    with pytest.raises(GroupMessageError) as caught:
        decode_update(blob, NUMEL)
    assert caught.value.reason == "old_version"


@pytest.mark.parametrize("bf16", [False, True])
def test_a_session_27_update_is_still_read(bf16: bool) -> None:
    """Session 27 wrote the compact fields (dht.grouping_fields) under DGU1/DGU2, and its
    shard digests are chunk roots: the same update, every check passing."""
    update = _reduced(bf16=bf16)
    meta = compact_meta(update)
    assert meta is not None
    blob = _old_update_bytes(update, meta)
    back = decode_update(blob, NUMEL)
    assert back == update and back.problem(lambda _: True) is None
    assert encode_update(back) == encode_update(update)  # passed on in the new form


# ---- notices ---------------------------------------------------------------------------------


def _old_notice_bytes(done: Done, identity: Identity, run_id: str = RUN) -> bytes:
    """A signed notice as sessions 14-27 encoded it (`DGD2`, the statement's domain
    `diloco-group-done/2`)."""
    statement = [run_id, done.group_key, done.epoch, done.round, list(done.included)]
    signed = b"diloco-group-done/2\n" + json.dumps(statement, separators=(",", ":")).encode()
    fields: dict[str, object] = {
        "run_id": run_id,
        "group_key": done.group_key,
        "epoch": done.epoch,
        "round": done.round,
        "included": list(done.included),
        "signer": identity.peer_id,
        "signature": identity.sign(signed).hex(),
    }
    if done.variant is not None:
        fields["variant"] = done.variant
    return b"DGD2" + json.dumps(fields, separators=(",", ":")).encode()


def _refusal(notice: SignedDone, sender: str) -> str | None:
    return notice_refusal(
        notice, sender, RUN, in_group=member_check(RUN, KEY), members=None, highest_round=5
    )


def test_the_new_notice_round_trips_bit_for_bit_and_its_signature_covers_the_version() -> None:
    done = Done.of(_reduced())
    notice = SignedDone.of(done, MEMBERS[0], RUN)
    blob = notice.to_bytes()
    assert blob[:4] == NOTICE_MAGIC == b"DGD3"
    back = decode_notice(blob)
    assert back == notice and back.to_bytes() == blob and back.verified()
    assert back.done.variant == done.variant and back.done.round_id == (KEY, 1, 3)
    assert _refusal(back, MEMBERS[0].peer_id) is None
    # An old notice relabelled as new does not verify: the version is in the signed statement.
    relabelled = NOTICE_MAGIC + _old_notice_bytes(done, MEMBERS[0])[4:]
    assert _refusal(decode_notice(relabelled), MEMBERS[0].peer_id) == "bad_signature"


@pytest.mark.parametrize("variant", [True, False], ids=["session_26_27", "session_14_25"])
def test_an_old_notice_is_refused_as_old_version(variant: bool) -> None:
    done = Done.of(_reduced())
    done = done if variant else replace(done, variant=None)
    with pytest.raises(GroupMessageError) as caught:
        decode_notice(_old_notice_bytes(done, MEMBERS[0]))
    assert caught.value.reason == "old_version"


# ---- the real exchange counts them as old_version ---------------------------------------------


class _Info:
    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id


def _exchange() -> tuple[GroupExchange, list[str], list[tuple[str, int, str]]]:
    rejected: list[str] = []
    offers: list[tuple[str, int, str]] = []
    network = SimpleNamespace(identity=Identity.generate(), config=SimpleNamespace(run_id=RUN))
    node = GroupExchange(
        network,  # type: ignore[arg-type]
        numel=NUMEL,
        reject=lambda reason, peer, detail: rejected.append(reason),
        is_alive=lambda _: True,
        offer=lambda key, seq, holder: offers.append((key, seq, holder)),
        applied_seq=lambda key: 4,
    )
    return node, rejected, offers


async def _deliver(node: GroupExchange, rpc: str, sender: str, blob: bytes) -> None:
    async def receive(reader: object, **_: object) -> bytes:
        return blob

    import dht.group_exchange_reads as ge  # where the exchange reads a stream

    original, ge.receive_blob = ge.receive_blob, receive  # type: ignore[assignment]
    try:
        await getattr(node, rpc)(_Info(sender), None, None)
        await asyncio.gather(*node._tasks)
    finally:
        ge.receive_blob = original


def test_the_exchange_counts_old_forms_as_old_version_and_takes_new_ones() -> None:
    update, sender = _reduced(), MEMBERS[0].peer_id
    old_update = _session_26(update)
    node, rejected, offers = _exchange()
    asyncio.run(_deliver(node, "rpc_done", sender, _old_notice_bytes(Done.of(update), MEMBERS[0])))
    old_blob = _old_update_bytes(old_update, full_meta(old_update))
    asyncio.run(_deliver(node, "rpc_update", sender, old_blob))
    assert rejected == ["group_done_old_version", "group_update_old_version"] and not offers
    unnamed = replace(Done.of(update), variant=None)  # no variant: nothing to wait for
    new = SignedDone.of(unnamed, MEMBERS[0], RUN).to_bytes()
    asyncio.run(_deliver(node, "rpc_done", sender, new))
    assert offers == [(KEY, update.seq, sender)] and len(rejected) == 2


# ---- arbitrary bytes never crash a decoder -----------------------------------------------------

_MAGICS = [b"", b"DGU1", b"DGU2", b"DGU3", b"DGU4", b"DGD1", b"DGD2", b"DGD3"]


@settings(max_examples=300, deadline=None)
@given(magic=st.sampled_from(_MAGICS), length=st.integers(0, 2**32 - 1), body=st.binary())
def test_arbitrary_bytes_are_read_or_refused_never_raised(
    magic: bytes, length: int, body: bytes
) -> None:
    for blob in (magic + body, magic + struct.pack(">I", length % (len(body) + 8)) + body):
        for decode in (lambda b: decode_update(b, 4), decode_notice):
            try:
                decode(blob)
            except GroupMessageError as exc:
                assert exc.reason in {"malformed", "old_version", "unsigned", "wrong_size",
                                      "not_finite"}  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    position=st.integers(0, 10**6),
    value=st.integers(0, 255),
    which=st.sampled_from(["dgu3", "dgu1_compact", "dgu1_full", "dgd3", "dgd2"]),
)
def test_a_flipped_byte_in_any_form_is_read_or_refused_never_raised(
    position: int, value: int, which: str
) -> None:
    update = UPDATE_FORMS[which]
    blob = bytearray(update)
    blob[position % len(blob)] = value
    try:
        if which.startswith("dgu"):
            back = decode_update(bytes(blob), NUMEL)
            back.problem(lambda _: True)
        else:
            decode_notice(bytes(blob))
    except GroupMessageError:
        pass


_U = _reduced()
_C = compact_meta(_U)
assert _C is not None
UPDATE_FORMS = {
    "dgu3": encode_update(_U),
    "dgu1_compact": _old_update_bytes(_U, _C),
    "dgu1_full": _old_update_bytes(_session_26(_U), full_meta(_session_26(_U))),
    "dgd3": SignedDone.of(Done.of(_U), MEMBERS[0], RUN).to_bytes(),
    "dgd2": _old_notice_bytes(Done.of(_U), MEMBERS[0]),
}
