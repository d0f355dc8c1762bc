"""Resumable update transfers (dht.resumable): what a cut stream brought is kept, the rest asked
for, and a peer that makes no progress, refuses or lies about the size is given up on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht import resumable
from dht.p2pd import DialError
from dht.resumable import (
    MAX_IDLE_ATTEMPTS,
    Resume,
    fetch_resumable,
    parse_part_request,
    part_answer,
)
from dht.state_parts import (
    KEEP_S,
    BufferWriter,
    SerializedStates,
    parse_transfer_id,
    serialized_state,
)
from dht.transport import HEADER, OK, REFUSED, TooLargeError, TransportError

ARGS = ["author", 7]


class Stream:
    """One stream to a server that answers from the offset asked, cut after `cut` bytes of its
    answer (None: never cut)."""

    def __init__(self, answer: Callable[[int], bytes], cut: int | None) -> None:
        self._answer, self._cut = answer, cut
        self._request = bytearray()
        self._out: bytes | bytearray | None = None
        self.closed = False

    # writer side
    def write(self, data: bytes) -> None:
        self._request += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    # reader side
    def _pending(self) -> bytearray:
        if self._out is None:
            args = json.loads(bytes(self._request[HEADER.size :]))["args"]
            assert args[:2] == ARGS
            out = self._answer(args[2])
            self._out = out if self._cut is None else out[: self._cut]
        return self._out  # type: ignore[return-value]

    async def readexactly(self, size: int) -> bytes:
        out = self._pending()
        if len(out) < size:
            self._out = b""
            raise asyncio.IncompleteReadError(bytes(out), size)
        self._out = out[size:]
        return bytes(out[:size])

    async def read(self, size: int) -> bytes:
        out = self._pending()
        self._out = out[size:]
        return bytes(out[:size])


def serving(blob: bytes, cuts: list[int | None]) -> tuple[Callable[[], object], list[Stream]]:
    """An opener whose i-th stream is cut after cuts[i] bytes (later ones are not cut)."""
    streams: list[Stream] = []

    def answer(offset: int) -> bytes:
        body = part_answer(blob, offset)
        return HEADER.pack(OK, len(body)) + body

    async def open_stream() -> tuple[Stream, Stream]:
        cut = cuts[len(streams)] if len(streams) < len(cuts) else None
        stream = Stream(answer, cut)
        streams.append(stream)
        return stream, stream

    return open_stream, streams


def fetch(open_stream: Callable[[], object], max_bytes: int = 1 << 30) -> tuple[bytes, int]:
    return asyncio.run(
        fetch_resumable(open_stream, ARGS, max_bytes=max_bytes, stall_timeout_s=1.0)  # type: ignore[arg-type]
    )


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resumable, "BACKOFF_S", 0.0)


def test_an_update_cut_every_100_kib_arrives_whole_in_as_many_streams() -> None:
    blob = bytes(range(256)) * 2000  # 512,000 bytes, as a relay cutting at ~100 KiB would
    open_stream, streams = serving(blob, [100_000] * 10)
    data, num_attempts = fetch(open_stream)
    assert data == blob
    assert num_attempts == len(streams) == 6  # 5 cut streams of ~100 KB, then the rest
    assert all(s.closed for s in streams)


def test_progress_is_told_as_bytes_arrive_across_cut_streams() -> None:
    blob = bytes(range(256)) * 2000
    open_stream, _ = serving(blob, [100_000] * 10)
    told: list[tuple[int, int]] = []
    data, _ = asyncio.run(
        fetch_resumable(open_stream, ARGS, max_bytes=1 << 30, stall_timeout_s=1.0,  # type: ignore[arg-type]
                        on_progress=lambda num_bytes, total: told.append((num_bytes, total)))
    )  # fmt: skip
    assert data == blob
    assert told[-1] == (len(blob), len(blob)) and {total for _, total in told} == {len(blob)}
    assert [n for n, _ in told] == sorted({n for n, _ in told})  # only ever grows


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(0, 40_000),
    cuts=st.lists(st.one_of(st.none(), st.integers(0, 20_000)), max_size=30),
)
def test_whatever_the_cuts_the_blob_arrives_whole_or_the_fetch_gives_up(
    size: int, cuts: list[int | None]
) -> None:
    blob = bytes(i % 251 for i in range(size))
    open_stream, streams = serving(blob, cuts)
    try:
        data, num_attempts = fetch(open_stream)
    except TransportError:  # only after MAX_IDLE_ATTEMPTS streams in a row brought nothing
        idle = [c is not None and c <= HEADER.size + 8 for c in cuts[: len(streams)]]
        assert idle[-MAX_IDLE_ATTEMPTS:] == [True] * MAX_IDLE_ATTEMPTS
        return
    assert data == blob and num_attempts == len(streams)


def test_a_peer_that_never_sends_a_byte_is_given_up_after_the_idle_limit() -> None:
    open_stream, streams = serving(b"x" * 1000, [0] * 100)
    with pytest.raises(TransportError, match="no progress"):
        fetch(open_stream)
    assert len(streams) == MAX_IDLE_ATTEMPTS


def test_a_refusal_ends_the_fetch_at_once() -> None:
    streams: list[Stream] = []

    async def open_stream() -> tuple[Stream, Stream]:
        stream = Stream(lambda _: HEADER.pack(REFUSED, 8) + b"not held", None)
        streams.append(stream)
        return stream, stream

    with pytest.raises(TransportError, match="refused: not held"):
        fetch(open_stream)
    assert len(streams) == 1


def test_an_announced_size_over_the_cap_is_refused_before_reading_it() -> None:
    open_stream, _ = serving(b"x" * 5000, [])
    with pytest.raises(TooLargeError):
        fetch(open_stream, max_bytes=4999)


def test_a_size_that_changes_starts_the_transfer_over_once_then_is_refused() -> None:
    resume = Resume(max_bytes=100)
    assert not resume.announce(50)
    resume.add(b"x" * 10)
    assert resume.announce(60) and resume.offset == 0  # another copy: from byte 0
    resume.add(b"y" * 20)
    with pytest.raises(TransportError, match="then"):
        resume.announce(50)
    with pytest.raises(TransportError, match="more than"):
        resume.add(b"x" * 41)


def test_a_donor_whose_copy_changed_mid_transfer_is_read_again_from_byte_0() -> None:
    """bench.chaos --topology nat: a donor served one copy of its state for the first part and
    another, 322 bytes longer, for every later one; the download gave up after 6 attempts."""
    first, second = b"a" * 300_000, b"b" * 300_322
    streams: list[Stream] = []

    def answer(offset: int) -> bytes:
        body = part_answer(first if len(streams) == 1 else second, offset)
        return HEADER.pack(OK, len(body)) + body

    async def open_stream() -> tuple[Stream, Stream]:
        stream = Stream(answer, 100_000 if len(streams) < 3 else None)
        streams.append(stream)
        return stream, stream

    data, num_attempts = fetch(open_stream)
    assert data == second and num_attempts == 4  # a cut part, the restart, 2 more parts


def test_backoff_grows_with_idle_attempts_and_resets_on_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(resumable, "BACKOFF_S", 0.2)
    resume = Resume(max_bytes=10)
    waits = []
    for _ in range(7):
        resume.attempt_ended(0)
        waits.append(resume.backoff_s())
    assert waits == [0.2, 0.4, 0.8, 1.6, 3.2, 3.2, 3.2]
    resume.attempt_ended(5)
    assert resume.backoff_s() == 0.0


@pytest.mark.parametrize(
    "args",
    [["a", 1], ["a", 1, -1], ["a", 0, 0], ["", 1, 0], ["a", 1, 1.5], ["a", 1, True], "x", None],
)
def test_malformed_part_requests_are_transport_errors(args: object) -> None:
    with pytest.raises(TransportError):
        parse_part_request(args)


def test_a_part_request_parses_to_its_id_and_offset() -> None:
    assert parse_part_request(["a", 3, 4096]) == (("a", 3), 4096)


def test_an_offset_past_the_end_is_refused() -> None:
    assert part_answer(b"abc", 3)[8:] == b""
    with pytest.raises(ValueError):
        part_answer(b"abc", 4)


# ---- state downloads in parts (dht.state_parts) ------------------------------------------------


def test_a_state_is_serialized_once_per_download_and_kept_within_bounds() -> None:
    states = SerializedStates(max_states=2)
    calls = []

    async def serialize(writer: BufferWriter) -> None:
        calls.append(1)
        writer.write(b"state-%d" % len(calls))
        await writer.drain()

    async def run() -> list[bytes | None]:
        got = [await serialized_state(states, ("a", "0" * 16), serialize)]
        got.append(await serialized_state(states, ("a", "0" * 16), serialize))  # the same
        got.append(await serialized_state(states, ("b", "1" * 16), serialize))
        got.append(await serialized_state(states, ("c", "2" * 16), serialize))  # no room: busy
        return got

    assert asyncio.run(run()) == [b"state-1", b"state-1", b"state-2", None]
    assert len(calls) == 2 and len(states) == 2


def test_a_kept_state_is_dropped_after_its_newcomer_falls_silent() -> None:
    states = SerializedStates(max_states=1)
    states.put(("a", "0" * 16), b"x", now=0.0)
    assert states.get(("a", "0" * 16), now=KEEP_S - 1) == b"x"  # a request keeps it alive
    assert states.admit("b", now=2 * KEEP_S - 2) is False
    assert states.admit("b", now=2 * KEEP_S) is True
    assert states.get(("a", "0" * 16), now=2 * KEEP_S) is None


def test_a_state_served_to_its_end_makes_room_for_the_next_download() -> None:
    states = SerializedStates(max_states=1)
    states.put(("a", "0" * 16), b"xyz", now=0.0)
    states.served(("a", "0" * 16), end=2)  # a part short of the end: still downloading
    assert states.admit("b", now=1.0) is False
    states.served(("a", "0" * 16), end=3)
    assert states.get(("a", "0" * 16), now=2.0) == b"xyz"  # kept while no one needs the room
    assert states.admit("b", now=3.0) is True  # then evicted, not "busy" for KEEP_S
    assert states.get(("a", "0" * 16), now=3.0) is None and len(states) == 0


def test_a_newcomer_holds_one_state_and_starts_few_downloads() -> None:
    states = SerializedStates(max_states=2)
    for i in range(3):  # its burst: each new download replaces its last
        assert states.admit("a", now=0.0)
        states.put(("a", f"{i:016x}"), b"x", now=0.0)
        assert len(states) == 1
    assert not states.admit("a", now=0.0)  # a fourth at once: refused as busy
    assert states.admit("b", now=0.0)  # others are not
    assert states.admit("a", now=10.0)  # one more after 1 / NEW_PER_S seconds


@pytest.mark.parametrize(
    "args", [["0" * 16], ["0" * 15, 0], ["G" * 16, 0], [7, 0], "x", ["0" * 16, 0, 1]]
)
def test_malformed_transfer_ids_are_transport_errors(args: object) -> None:
    with pytest.raises(TransportError):
        parse_transfer_id(args)


def dialling(blob: bytes, plan: list[str]) -> tuple[Callable[[], object], list[str]]:
    """An opener whose i-th dial follows plan[i]: "fail" (no stream: DialError), "cut" (a
    stream cut after 1,000 bytes of its answer), "idle" (a stream that brings nothing);
    past the plan, whole streams."""
    tried: list[str] = []
    open_whole, _ = serving(blob, [])
    open_cut, _ = serving(blob, [HEADER.size + 8 + 1000] * len(plan))
    open_idle, _ = serving(blob, [0] * len(plan))

    async def open_stream() -> object:
        step = plan[len(tried)] if len(tried) < len(plan) else "whole"
        tried.append(step)
        if step == "fail":
            raise DialError("no stream to peer: error opening relay circuit: NO_RESERVATION")
        opener = {"cut": open_cut, "idle": open_idle}.get(step, open_whole)
        return await opener()  # type: ignore[misc]

    return open_stream, tried


def fetch_dialling(open_stream: Callable[[], object], max_dial_failures: int | None) -> bytes:
    data, _ = asyncio.run(
        fetch_resumable(open_stream, ARGS, max_bytes=1 << 30, stall_timeout_s=1.0,  # type: ignore[arg-type]
                        max_dial_failures=max_dial_failures)
    )  # fmt: skip
    return data


def test_a_peer_that_cannot_be_dialled_is_left_after_max_dial_failures() -> None:
    """The chaos run's restart: a donor whose relay slot was gone got 6 attempts (~10 s)."""
    open_stream, tried = dialling(b"x" * 5000, ["fail"] * 10)
    with pytest.raises(DialError, match="could not dial in 2 attempts"):
        fetch_dialling(open_stream, max_dial_failures=2)
    assert tried == ["fail", "fail"]
    open_stream, tried = dialling(b"x" * 5000, ["fail"] * 10)  # without the limit: as before
    with pytest.raises(TransportError, match="attempts"):
        fetch_dialling(open_stream, max_dial_failures=None)
    assert len(tried) == MAX_IDLE_ATTEMPTS


def test_failed_dials_after_a_stream_opened_are_redials_of_a_cut_circuit() -> None:
    """Once the peer answered, a dial that fails is the relay's cut: resume from the bytes."""
    blob = bytes(range(256)) * 20
    plan = ["cut", "fail", "fail", "fail", "cut", "fail", "fail"]
    open_stream, tried = dialling(blob, plan)
    assert fetch_dialling(open_stream, max_dial_failures=2) == blob
    assert tried == [*plan, "whole"]


@settings(max_examples=80, deadline=None)
@given(
    plan=st.lists(st.sampled_from(["fail", "cut", "idle"]), max_size=16),
    max_dial_failures=st.one_of(st.none(), st.integers(1, 3)),
)
def test_dial_failures_end_a_fetch_only_before_any_stream_opened(
    plan: list[str], max_dial_failures: int | None
) -> None:
    blob = bytes(i % 251 for i in range(30_000))
    open_stream, tried = dialling(blob, plan)
    try:
        assert fetch_dialling(open_stream, max_dial_failures) == blob
    except TransportError as exc:
        opened = any(step != "fail" for step in tried)
        if isinstance(exc, DialError) and max_dial_failures is not None and not opened:
            assert tried == ["fail"] * max_dial_failures  # left at once, never later
            return
        # otherwise only the idle rule: MAX_IDLE_ATTEMPTS in a row that brought no byte
        assert len(tried) >= MAX_IDLE_ATTEMPTS
        assert all(step in ("fail", "idle") for step in tried[-MAX_IDLE_ATTEMPTS:])
        return
    # a fetch that arrived whole never gave up on the dial rule while it could still have
    if max_dial_failures is not None:
        assert tried[:max_dial_failures] != ["fail"] * max_dial_failures


def test_resume_counts_dial_failures_in_a_row_and_forgets_them_once_a_stream_opens() -> None:
    resume = Resume(max_bytes=10, max_dial_failures=2)
    resume.attempt_ended(0, dialled=False)
    assert not resume.exhausted
    resume.attempt_ended(0, dialled=True)
    resume.attempt_ended(0, dialled=False)
    resume.attempt_ended(0, dialled=False)
    assert resume.opened and resume.dial_failures == 2 and not resume.exhausted
    fresh = Resume(max_bytes=10, max_dial_failures=2)
    fresh.attempt_ended(0, dialled=False)
    fresh.attempt_ended(0, dialled=False)
    assert fresh.exhausted
