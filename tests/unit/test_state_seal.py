"""A donor seals the state it streams; a newcomer refuses one whose bytes or applied set do not
match what the donor signed, or that no seal of the donor's covers."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.messages import MessageError, StateSeal, parse_state_seal
from dht.state_check import StateCheckError, applied_digest
from dht.state_transfer import check_seal, receive_state, send_state
from tests.unit.test_handover import CAROL
from tests.unit.test_merge_pipeline import (
    ALICE,
    BOB,
    DELTA,
    FINGERPRINT,
    make_pipeline,
    make_update,
)


class Pipe:
    """Both ends of one stream; `flip` corrupts the byte at that offset in transit."""

    def __init__(self, flip: int | None = None, cut_after: int | None = None) -> None:
        self.reader = asyncio.StreamReader()
        self.sent = 0
        self.writes: list[int] = []
        """Where each write began."""
        self.flip, self.cut_after = flip, cut_after

    def write(self, data: bytes | memoryview) -> None:
        self.writes.append(self.sent)
        chunk = bytearray(data)
        if self.flip is not None and self.sent <= self.flip < self.sent + len(chunk):
            chunk[self.flip - self.sent] ^= 0x01
        if self.cut_after is not None:
            chunk = chunk[: max(0, self.cut_after - self.sent)]
        self.sent += len(data)
        self.reader.feed_data(bytes(chunk))

    async def drain(self) -> None:
        return None


def donor_state() -> dict[str, Any]:
    pipeline = make_pipeline()
    for seq in range(3):
        assert pipeline.submit(make_update(ALICE, DELTA, seq=seq, learners=2)).accepted
    return pipeline.transfer_state()


def transfer(
    state: dict[str, Any],
    *,
    flip: int | None = None,
    cut_after: int | None = None,
    signer: Any = ALICE,
    fingerprint: str = FINGERPRINT,
) -> tuple[dict[str, Any], int]:
    async def run() -> tuple[dict[str, Any], int]:
        pipe = Pipe(flip, cut_after)
        sent = await send_state(pipe, state, signer, fingerprint)  # type: ignore[arg-type]
        pipe.reader.feed_eof()
        received = await receive_state(
            pipe.reader, ALICE.peer_id, fingerprint=FINGERPRINT, max_state_bytes=1 << 20
        )
        assert sent > received[1]  # the seal's bytes besides
        return received

    return asyncio.run(run())


def writes_of(state: dict[str, Any]) -> list[int]:
    async def run() -> list[int]:
        pipe = Pipe()
        await send_state(pipe, state, ALICE, FINGERPRINT)  # type: ignore[arg-type]
        return pipe.writes

    return asyncio.run(run())


def test_a_sealed_state_arrives_whole_and_is_what_the_donor_served() -> None:
    state = donor_state()
    received, total = transfer(state)
    assert torch.equal(received["params"], state["params"])
    assert received["applied"] == state["applied"] and received["merge"] == state["merge"]
    assert total > state["params"].numel() * 4
    make_pipeline().adopt(received)


def test_a_byte_changed_in_transit_is_refused() -> None:
    state = donor_state()
    last_tensor = writes_of(state)[-3]  # then the seal's length, then the seal
    with pytest.raises(StateCheckError, match="do not hash"):
        transfer(state, flip=last_tensor)


def test_a_state_without_its_donors_seal_is_refused() -> None:
    state = donor_state()
    seal_starts = writes_of(state)[-2]
    with pytest.raises(StateCheckError, match="without its donor's seal"):
        transfer(state, cut_after=seal_starts)  # as from a donor of an earlier version


def test_a_seal_by_another_key_or_of_another_run_is_refused() -> None:
    with pytest.raises(MessageError) as raised:
        transfer(donor_state(), signer=BOB)  # Bob's seal on a stream from Alice
    assert raised.value.reason == "bad_signature"
    with pytest.raises(StateCheckError, match="another run"):
        transfer(donor_state(), fingerprint="0" * 64)


def test_the_seal_binds_the_applied_set_the_state_holds() -> None:
    state = donor_state()
    applied = state["applied"]
    seal = StateSeal(fingerprint=FINGERPRINT, donor=ALICE.peer_id, num_bytes=10,
                     state_blake3="a" * 64, num_applied=3,
                     applied_digest=applied_digest(applied))  # fmt: skip
    check_seal(seal, state, FINGERPRINT, 10, "a" * 64)
    fewer = {**state, "applied": {ALICE.peer_id: applied[ALICE.peer_id][:2]}, "num_applied": 2}
    with pytest.raises(StateCheckError, match="not the one its donor sealed"):
        check_seal(seal, fewer, FINGERPRINT, 10, "a" * 64)
    with pytest.raises(StateCheckError, match="do not hash"):
        check_seal(seal, state, FINGERPRINT, 11, "a" * 64)


SEAL = StateSeal(fingerprint=FINGERPRINT, donor=CAROL.peer_id, num_bytes=1234,
                 state_blake3="b" * 64, num_applied=7, applied_digest="c" * 64)  # fmt: skip
BLOB = SEAL.sign(CAROL)


def test_a_seal_round_trips_and_names_its_donor() -> None:
    assert parse_state_seal(BLOB, donor=CAROL.peer_id) == SEAL
    with pytest.raises(MessageError):
        parse_state_seal(BLOB, donor=ALICE.peer_id)
    with pytest.raises(ValueError, match="signed by its donor"):
        SEAL.sign(ALICE)


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, len(BLOB) - 1), byte=st.integers(1, 255))
def test_a_mutated_seal_is_refused(position: int, byte: int) -> None:
    blob = bytearray(BLOB)
    blob[position] ^= byte
    with pytest.raises(MessageError):
        parse_state_seal(bytes(blob), donor=CAROL.peer_id)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=5000) | st.none() | st.text(max_size=10))
def test_arbitrary_input_as_a_seal_raises_only_message_errors(blob: object) -> None:
    with contextlib.suppress(MessageError):
        parse_state_seal(blob, donor=CAROL.peer_id)
