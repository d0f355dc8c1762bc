"""--codec auto: the uplink measured from the node's own sends, and the codec picked by it."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from merge.codec_policy import AUTO_CODECS, START_CODEC, CodecPicker, pick_codec
from merge.codec_uplink import UplinkMeter
from merge.codecs import get_codec

NUMEL = 10_844_160  # the `small` model
MBIT = 1e6 / 8


def test_nothing_measured_until_a_large_enough_send_ends() -> None:
    meter = UplinkMeter(min_bytes=1000)
    meter.begin(0.0)
    assert meter.bytes_per_s() is None  # in flight
    meter.end(1.0, 999)  # too small: times local buffers, not the link
    assert meter.bytes_per_s() is None
    meter.begin(2.0)
    meter.end(4.0, 5000)
    assert meter.bytes_per_s() == 2500


def test_overlapping_sends_share_the_link_and_count_their_time_once() -> None:
    meter = UplinkMeter(min_bytes=1)
    meter.begin(0.0)  # the same update served to two peers at once
    meter.begin(0.5)
    meter.end(2.0, 1000)
    meter.end(4.0, 1000)

    assert meter.bytes_per_s() == 500  # 2,000 bytes over the 4 busy seconds
    assert meter.samples() == 1


def test_an_end_without_a_begin_is_ignored_and_a_bad_meter_is_refused() -> None:
    meter = UplinkMeter(min_bytes=1)
    meter.end(1.0, 10**9)
    assert meter.bytes_per_s() is None
    with pytest.raises(ValueError):
        UplinkMeter(min_bytes=0)


@settings(max_examples=80, deadline=None)
@given(
    rate=st.floats(1e3, 1e9),
    sends=st.lists(st.tuples(st.floats(0.0, 100.0), st.floats(0.001, 100.0)), min_size=1),
)
def test_sends_at_one_rate_measure_that_rate(rate: float, sends: list) -> None:
    """One send after the other, each moving `rate` bytes a second: the meter says `rate`
    (within what rounding each send to whole bytes makes of it: 1 byte in 1 ms is not 1122)."""
    meter, now, realized = UplinkMeter(min_bytes=1), 0.0, []
    for gap, seconds in sends:
        now += gap
        meter.begin(now)
        now += seconds
        meter.end(now, round(rate * seconds))
        if round(rate * seconds):
            realized.append(round(rate * seconds) / seconds)
    measured = meter.bytes_per_s()
    if measured is not None:  # None only when every send rounded to 0 bytes
        assert min(realized) * (1 - 1e-6) <= measured <= max(realized) * (1 + 1e-6)


@settings(max_examples=80, deadline=None)
@given(
    sends=st.lists(
        st.tuples(st.floats(0.0, 50.0), st.floats(0.0, 50.0), st.integers(0, 10**7)),
        min_size=1,
        max_size=12,
    )
)
def test_the_figure_is_bytes_over_the_union_of_the_send_intervals(sends: list) -> None:
    """Against an independent count: intervals merged, bytes summed, per busy period."""
    events = []
    for start, length, size in sends:
        events += [(start, 0, 0), (start + length, 1, size)]  # at one instant: begins first
    meter = UplinkMeter(min_bytes=1, samples=10**6)
    for at, kind, size in sorted(events):
        if kind == 0:
            meter.begin(at)
        else:
            meter.end(at, size)

    intervals = sorted((start, start + length, size) for start, length, size in sends)
    periods: list[list[float]] = []
    for start, end, size in intervals:
        if periods and start <= periods[-1][1]:
            periods[-1][1] = max(periods[-1][1], end)
            periods[-1][2] += size
        else:
            periods.append([start, end, size])
    counted = [(b, e - s) for s, e, b in periods if b >= 1 and e > s]
    expected = sum(b for b, _ in counted) / sum(t for _, t in counted) if counted else None
    measured = meter.bytes_per_s()
    if expected is None:
        assert measured is None
    else:
        assert measured == pytest.approx(expected, rel=1e-6)


def test_send_blob_feeds_the_process_uplink_meter() -> None:
    """dht.transport's send path reports each blob it sends over a real socket."""
    from dht.transport import UPLINK, receive_blob, send_blob

    blob = b"x" * (4 << 20)

    async def exchange() -> bytes:
        received: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            received.set_result(await receive_blob(reader, max_bytes=len(blob)))
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            await send_blob(writer, blob)
            data = await asyncio.wait_for(received, 30)
            writer.close()
        return data

    before = UPLINK.samples()
    assert asyncio.run(exchange()) == blob

    assert UPLINK.samples() == min(before + 1, 32)
    measured = UPLINK.bytes_per_s()
    assert measured is not None and measured > 0


def test_auto_starts_with_bf16_and_picks_nothing_until_measured() -> None:
    picker = CodecPicker(NUMEL)
    assert picker.codec == START_CODEC == "bf16"
    assert picker.round_start(0.0, 5 * MBIT, 8) is None  # no round time yet
    assert picker.round_start(60.0, None, 8) is None  # no uplink yet
    assert picker.codec == "bf16"


def test_auto_on_a_home_uplink_moves_to_topk_and_on_a_fat_link_stays_bf16() -> None:
    thin, fat = CodecPicker(NUMEL), CodecPicker(NUMEL)
    for picker in (thin, fat):
        picker.round_start(0.0, None, 8)
    home = thin.round_start(60.0, 5 * MBIT, 8)
    office = fat.round_start(60.0, 1000 * MBIT, 8)

    assert home is not None and (home.codec, home.fits) == ("topk", True)
    assert office is not None and office.codec == "bf16"


def _size(codec: str) -> int:
    return get_codec(codec).payload_bytes(NUMEL)


@settings(max_examples=60, deadline=None)
@given(
    uplink=st.floats(1e4, 1e10),
    round_s=st.floats(1.0, 3600.0),
    learners=st.integers(1, 64),
    rounds=st.integers(2, 8),
)
def test_at_a_steady_uplink_the_choice_settles_and_fits_when_anything_does(
    uplink: float, round_s: float, learners: int, rounds: int
) -> None:
    picker = CodecPicker(NUMEL)
    picker.round_start(0.0, uplink, learners)
    choices = [picker.round_start(round_s * (i + 1), uplink, learners) for i in range(rounds)]
    names = [c.codec for c in choices if c is not None]

    assert len(names) == rounds and len(set(names[1:])) <= 1  # no flapping
    best = pick_codec(numel=NUMEL, uplink_bytes_per_s=uplink, round_s=round_s, learners=learners)
    assert choices[-1] is not None and choices[-1].fits == best.fits
    assert _size(names[-1]) <= _size(best.codec)  # never more than fits


@settings(max_examples=60, deadline=None)
@given(
    uplinks=st.lists(st.floats(1e4, 1e10), min_size=2, max_size=10),
    learners=st.integers(2, 16),
)
def test_a_lossier_codec_comes_at_once_a_less_lossy_one_only_with_room_to_spare(
    uplinks: list[float], learners: int
) -> None:
    picker = CodecPicker(NUMEL)
    picker.round_start(0.0, None, learners)
    for i, uplink in enumerate(uplinks):
        before = picker.codec
        choice = picker.round_start(60.0 * (i + 1), uplink, learners)
        assert choice is not None and choice.codec in AUTO_CODECS
        if _size(choice.codec) > _size(before):  # moved up: fits half the budget
            assert choice.upload_s <= 0.5 * choice.budget_s
        full = pick_codec(numel=NUMEL, uplink_bytes_per_s=uplink, round_s=60.0, learners=learners)
        if full.fits:
            assert choice.fits
