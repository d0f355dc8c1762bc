"""Every number in a heartbeat is finite and within its declared bounds, or the heartbeat is
refused and counted, never raised: 10**400, NaN and infinities in every numeric field, read
through membership as a peer's record arrives."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.heartbeat import Heartbeat, HeartbeatError, sign_fields
from dht.records import owner_subkey
from tests.factories import identity
from tests.unit.test_membership_hold import membership, record

PEER = identity("p")
ME = identity("q")
HOSTILE = [10**400, -(10**400), float("nan"), float("inf"), float("-inf"), 2**64, -1, 1e300]
_NUMERIC = re.compile(r"\b(Count|Seconds|Rate|Loss|float|int|SketchValue)\b")


def _setter(
    name: str, wrap: Callable[[object], object]
) -> Callable[[dict[str, Any], object], None]:
    """Puts a value, wrapped as the field holds it, into a heartbeat's fields."""
    return lambda fields, value: fields.__setitem__(name, wrap(value))


def _setters() -> dict[str, Callable[[dict[str, Any], object], None]]:
    """Where each number of a heartbeat lives: top-level fields and inside lists and dicts."""
    setters: dict[str, Callable[[dict[str, Any], object], None]] = {}
    for f in dataclasses.fields(Heartbeat):
        kind = str(f.type)
        if not _NUMERIC.search(kind):
            continue
        name = f.name
        if kind.startswith("Annotated[list"):
            setters[f"{name}[0]"] = _setter(name, lambda v: [v])
        elif name == "paths":  # keys are the path kinds: a valid key, so the value is tested
            setters[f"{name}.relayed"] = _setter(name, lambda v: {"relayed": v})
        elif name == "rejected_peers":
            setters[f"{name}.p.r"] = _setter(name, lambda v: {"p": {"r": v}})
        elif kind.startswith("Annotated[dict"):
            setters[f"{name}.k"] = _setter(name, lambda v: {"k": v})
        else:
            setters[name] = _setter(name, lambda v: v)
    return setters


SETTERS = _setters()


def test_every_numeric_field_is_covered() -> None:
    expected = {"memory_gb", "loss", "sent_at", "sketch[0]", "merged_by_author.k", "num_lost"}
    expected |= {"paths.relayed", "num_realigned", "group_bits", "group_epoch"}
    expected |= {"uplink_bytes_per_s", "num_need_state"}
    assert expected <= set(SETTERS) and len(SETTERS) == 29


def hostile_blob(where: str, value: object) -> bytes:
    fields = dataclasses.asdict(Heartbeat(peer_id=PEER.peer_id, sent_at=1.0))
    SETTERS[where](fields, value)
    return sign_fields(fields, PEER)  # NaN and Infinity written as Python's json writes them


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize("where", sorted(SETTERS))
def test_a_hostile_number_anywhere_is_refused_and_counted_never_raised(
    where: str, value: object
) -> None:
    if value == -1 and where in ("sketch[0]",):
        pytest.skip("a sketch value may be negative")
    m = membership(ME, [{owner_subkey(PEER.peer_id): hostile_blob(where, value)}])
    seen = asyncio.run(m.poll())
    assert seen == [] and not m.is_alive(PEER.peer_id)
    assert m._reject.counts == {"heartbeat_malformed": 1}  # type: ignore[attr-defined]


@settings(max_examples=60, deadline=None)
@given(
    where=st.sampled_from(sorted(SETTERS)),
    value=st.floats(allow_nan=True, allow_infinity=True) | st.integers(),
)
def test_a_heartbeat_parses_to_finite_numbers_or_is_refused(where: str, value: object) -> None:
    try:
        heartbeat = Heartbeat.verify(hostile_blob(where, value), PEER.peer_id)
    except HeartbeatError as exc:
        assert exc.reason == "malformed"
        return
    fields = dataclasses.asdict(heartbeat)
    for number in _numbers(fields):
        assert abs(number) < 2**63 and number == number  # finite, not NaN, fits an int64


def _numbers(value: object) -> list[float]:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return []
    if isinstance(value, int | float):
        return [value]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def test_an_honest_heartbeat_still_parses() -> None:
    m = membership(ME, [record(PEER)])
    assert [h.peer_id for h in asyncio.run(m.poll())] == [PEER.peer_id]
