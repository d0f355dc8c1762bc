"""Update transfers that survive a cut stream: the fetcher keeps what arrived and asks for the rest.

Why: a relayed connection between two NAT'd nodes is cut after 128 KiB each way. hivemind
1.1.12's p2pd starts a second circuit relay v2 service with go-libp2p's default resources
(`EnableRelayV2`: `relay.New(host)`, Limit.Data = 1 << 17, Limit.Duration = 2 min) beside the
one `-relayDataLimit` configures; both register the same hop protocol and the last one wins.
No p2pd flag removes it: which one serves is the order of two goroutines. This project's
relays (a bootstrap, a node with --announce) run p2pd with GOMAXPROCS=1, under which the
configured one registered last in 4 of 4 starts (dht.reachability: daemon_env); any other
relay (`hivemind-dht`, a public node without --announce before AutoNAT confirms it) cuts. On a
cut the fetcher's stream ends early (EOF, or a reset), and the next stream to the same peer
dials a fresh circuit: each circuit carries the next ~100 KiB.

The protocol: a request names (author, seq, offset); the answer is the update's total size
and its bytes from `offset`, up to PART_BYTES. `Resume` (pure) decides what to ask next and
when to give up; `fetch_resumable` runs it over streams.

A peer the daemon cannot open a single stream to (dht.p2pd.DialError: no route, or a relayed
address whose relay holds no slot for it, `NO_RESERVATION`) is not a stalled transfer: in
the NAT chaos run a restart's state download spent all MAX_IDLE_ATTEMPTS (~10 s) on such a
donor before trying the next. A caller with other peers to ask passes `max_dial_failures`:
the fetch gives up after that many failed dials in a row while no stream to the peer has
opened. Once one has, a dial that fails is a circuit to redial (the relay cut the last one),
and counts as an attempt without progress, as before.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from dht.messages import MAX_SEQ
from dht.p2pd import DialError
from dht.transport import (
    HEADER,
    OK,
    REFUSED,
    WIRE_BYTES,
    StreamBroken,
    TooLargeError,
    TransportError,
    encode_request,
)

TOTAL = struct.Struct(">Q")
PART_BYTES = 16 << 20
"""The most one answer carries (a direct connection moves a whole tiny/small update at once)."""
READ_BYTES = 64 << 10
MAX_OFFSET = 1 << 40
MAX_IDLE_ATTEMPTS = 6
"""Attempts in a row that brought no byte (refused as busy, cut at once) before giving up."""
BACKOFF_S = 0.2
"""Wait before an attempt that follows one without progress, doubled each time (max 3.2 s)."""
MAX_RESTARTS = 1
"""Times a transfer starts over from byte 0 when the peer announces another size: its copy
changed (a donor serialized its state again for the same transfer, two first requests racing
while a merge landed, bench.chaos --topology nat: "peer announced 5358466 bytes, then
5358144" six times, then the next donor, 40 s into the restart). Once more would be a peer
that changes its size on purpose: refused as before."""


@dataclass(kw_only=True)
class Resume:
    """What an interrupted download has: the bytes so far, the size the peer announced, and
    how many attempts in a row brought nothing."""

    max_bytes: int
    data: bytearray = field(default_factory=bytearray)
    total: int | None = None
    idle_attempts: int = 0
    num_attempts: int = 0
    max_dial_failures: int | None = None
    """Failed dials in a row that end the fetch while no stream has opened (None: only
    MAX_IDLE_ATTEMPTS ends it)."""
    dial_failures: int = 0
    """Failed dials in a row (no stream opened)."""
    opened: bool = False
    """Whether any stream to the peer opened."""
    restarts: int = 0
    """Times the transfer started over because the peer's size changed (MAX_RESTARTS)."""
    on_progress: Callable[[int, int], None] | None = None
    """Told (bytes so far, total) as bytes arrive (dht.transfer_progress)."""

    @property
    def offset(self) -> int:
        return len(self.data)

    @property
    def done(self) -> bool:
        return self.total is not None and self.offset == self.total

    @property
    def exhausted(self) -> bool:
        if self.idle_attempts >= MAX_IDLE_ATTEMPTS:
            return True
        limit = self.max_dial_failures
        return limit is not None and not self.opened and self.dial_failures >= limit

    def backoff_s(self) -> float:
        """How long to wait before the next attempt (0 after one that made progress)."""
        return 0.0 if self.idle_attempts == 0 else BACKOFF_S * 2 ** min(self.idle_attempts - 1, 4)

    def announce(self, total: int) -> bool:
        """The peer's size of the whole update; True when it changed and the transfer starts
        over from byte 0 (the bytes so far were of another copy: MAX_RESTARTS times at most)."""
        if total > self.max_bytes:
            raise TooLargeError(f"peer announced {total} bytes, more than the {self.max_bytes} cap")
        restart = self.total is not None and total != self.total
        if restart:
            if self.restarts >= MAX_RESTARTS:
                raise TransportError(f"peer announced {total} bytes, then {self.total}")
            self.restarts += 1
            self.data = bytearray()
        elif total < self.offset:
            raise TransportError(f"peer announced {total} bytes, {self.offset} already received")
        self.total = total
        return restart

    def add(self, part: bytes) -> None:
        """Bytes that arrived at `offset` (a part may end early: a cut stream)."""
        assert self.total is not None, "announce the total first"
        if self.offset + len(part) > self.total:
            raise TransportError("peer sent more than the size it announced")
        self.data += part
        if self.on_progress is not None:
            self.on_progress(self.offset, self.total)

    def attempt_ended(self, received: int, *, dialled: bool = True) -> None:
        """An attempt brought `received` bytes; `dialled`: a stream opened (False: the dial
        itself failed)."""
        self.num_attempts += 1
        self.idle_attempts = 0 if received > 0 else self.idle_attempts + 1
        self.opened |= dialled
        self.dial_failures = 0 if dialled else self.dial_failures + 1


Opener = Callable[[], Awaitable[tuple[Any, Any]]]


async def fetch_resumable(
    open_stream: Opener,
    args: list[Any],
    *,
    max_bytes: int,
    stall_timeout_s: float,
    on_progress: Callable[[int, int], None] | None = None,
    max_dial_failures: int | None = None,
) -> tuple[bytes, int]:
    """The whole blob that `args` names and the number of attempts it took, however many
    streams it took; TransportError (or TooLargeError, TimeoutError) when the peer refused it,
    made no progress MAX_IDLE_ATTEMPTS times in a row, or (`max_dial_failures`) could not be
    dialled that many times in a row before any stream opened (DialError). The caller bounds
    the total time."""
    resume = Resume(
        max_bytes=max_bytes, on_progress=on_progress, max_dial_failures=max_dial_failures
    )
    while not resume.done:
        await asyncio.sleep(resume.backoff_s())
        received, dialled = 0, True
        try:
            received = await _attempt(open_stream, args, resume, stall_timeout_s)
        except (TransportError, OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            if isinstance(exc, TooLargeError) or is_refusal(exc):
                raise
            error: BaseException = exc
            dialled = not isinstance(exc, DialError)
        else:
            error = TransportError("peer closed the stream early")
        resume.attempt_ended(received, dialled=dialled)
        if not resume.done and resume.exhausted:
            if not resume.opened and not dialled:
                raise DialError(f"could not dial in {resume.dial_failures} attempts: {error}")
            raise StreamBroken(f"no progress in {resume.idle_attempts} attempts: {error}")
    return bytes(resume.data), resume.num_attempts


def is_refusal(exc: BaseException) -> bool:
    """Whether `exc` is the peer's refusal ("not held"): asking it again brings nothing."""
    return isinstance(exc, TransportError) and str(exc).startswith("peer refused")


async def _attempt(open_stream: Opener, args: list[Any], resume: Resume, stall_s: float) -> int:
    """One stream: ask from `resume.offset`, keep what arrives until the part ends or is cut.
    The bytes received (0 when the stream brought nothing)."""
    reader, writer = await open_stream()
    before = resume.offset
    try:
        request = encode_request(args=[*args, resume.offset])
        writer.write(HEADER.pack(OK, len(request)) + request)
        await writer.drain()
        status, length = HEADER.unpack(await _exactly(reader, HEADER.size, stall_s))
        if status == REFUSED:
            reason = await _exactly(reader, min(length, 200), stall_s)
            raise TransportError(f"peer refused: {reason.decode(errors='replace')}")
        if status != OK or length < TOTAL.size:
            raise TransportError(f"malformed answer (status {status}, {length} bytes)")
        if resume.announce(TOTAL.unpack(await _exactly(reader, TOTAL.size, stall_s))[0]):
            before = 0  # started over: the next stream asks from byte 0 of the peer's new copy
            return 0
        left = length - TOTAL.size
        while left > 0:
            chunk = await asyncio.wait_for(reader.read(min(READ_BYTES, left)), stall_s)
            if not chunk:
                break
            resume.add(chunk)
            left -= len(chunk)
        return resume.offset - before
    except (TransportError, OSError, TimeoutError, asyncio.IncompleteReadError):
        if resume.offset > before:  # what arrived before the cut is kept
            return resume.offset - before
        raise
    finally:
        WIRE_BYTES.add(received=resume.offset - before)
        writer.close()


async def _exactly(reader: Any, size: int, stall_s: float) -> bytes:
    return bytes(await asyncio.wait_for(reader.readexactly(size), stall_s))


def part_answer(blob: bytes, offset: int) -> bytes:
    """The answer to a request from `offset`: the total size, then up to PART_BYTES bytes."""
    if not 0 <= offset <= len(blob):
        raise ValueError(f"offset {offset} is outside the {len(blob)}-byte update")
    return TOTAL.pack(len(blob)) + blob[offset : offset + PART_BYTES]


def parse_part_request(args: object) -> tuple[tuple[str, int], int]:
    """The update id (author, seq) and the offset a peer asks from; TransportError otherwise."""
    if not isinstance(args, list) or len(args) != 3:
        raise TransportError("malformed request")
    author, seq, offset = args
    if not isinstance(author, str) or not 0 < len(author) <= 128:
        raise TransportError("malformed request: the author is not a short string")
    if type(seq) is not int or not 1 <= seq <= MAX_SEQ:
        raise TransportError("malformed request: the seq is not an integer in range")
    return (author, seq), parse_offset(args)


def parse_offset(args: object) -> int:
    """The offset a part request asks from: its args' last item, an integer in range."""
    offset = args[-1] if isinstance(args, list) and args else None
    if type(offset) is not int or not 0 <= offset <= MAX_OFFSET:
        raise TransportError("malformed request: the offset is not an integer in range")
    return offset
