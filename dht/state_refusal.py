"""Why a state download loaded nothing: a donor's lie (`bad_state`, counted against it), or a
donor busy or out of reach, which costs it nothing (dht.state_transfer; the `realign_refused`
event carries it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dht.p2pd import DialError
from dht.state_check import StateCheckError
from dht.transport import StreamBroken, TransportError

BUSY = "busy serving other newcomers"
"""The refusal a donor serving as many downloads as it may sends."""


@dataclass(frozen=True)
class StateRefusal:
    """Why a download loaded nothing (the `realign_refused` event carries it)."""

    donor: str
    reason: str
    """`bad_state`: the donor sent a state to refuse (counted against it); `busy`: it serves
    others; `unreachable`: no whole stream came (a dial failed, a stream broke or timed
    out: the donor died, a link reset), counted against nobody and bounded by the caller's
    attempts (dht.realign's cooldown and cap, `download`'s passes)."""
    check: str
    """The state check that refused it (dht.state_check.StateCheckError.check: `same_digest`,
    `distance`, `momentum`, `own_seq`, `malformed`, `seal`), `transport`, or the failure."""
    detail: str
    distances: dict[str, float] = field(default_factory=dict)
    """What the refusing check measured (relative distances)."""


def classify_failure(donor: str, exc: Exception) -> StateRefusal:
    """What a failed download from `donor` was: a lie (`bad_state`), or a donor busy or out
    of reach, which costs it nothing."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, StateCheckError):
        return StateRefusal(donor, "bad_state", exc.check, detail, exc.distances)
    if isinstance(exc, TransportError) and BUSY in detail:
        return StateRefusal(donor, "busy", "busy", detail)
    if isinstance(exc, StreamBroken | DialError | TimeoutError):
        return StateRefusal(donor, "unreachable", type(exc).__name__, detail)
    if isinstance(exc, TransportError):  # it sent what we will not read
        return StateRefusal(donor, "bad_state", "transport", detail)
    if isinstance(exc, OSError):
        return StateRefusal(donor, "unreachable", type(exc).__name__, detail)
    check = "malformed" if isinstance(exc, ValueError) else type(exc).__name__
    return StateRefusal(donor, "bad_state", check, detail)
