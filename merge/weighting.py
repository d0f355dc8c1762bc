"""How much an update counts: staleness and token weights, pure functions of its header.

Staleness is weighed in rounds of the swarm, the unit of the outer step (merge.outer): an
update sized by M learners is one of M that a synchronous round would apply together, so the
M - 1 other updates its replica merged while its round ran do not make it stale; those beyond
them do, by 1/M of a round each. With s the updates applied while the round ran:

    rounds stale = max(0, s - (M - 1)) / M

so in a swarm of M equal learners an update of the current round weighs 1, as in synchronous
DiLoCo, and a slow learner's update that missed k whole rounds is k rounds stale. With M = 1
(one learner, or a v1 header) it is s itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

StalenessKind = Literal["constant", "polynomial", "hinge", "exponential"]
TokenWeightKind = Literal["tokens", "none"]


@dataclass(frozen=True, kw_only=True)
class StalenessConfig:
    """Down-weights an update by its staleness s, in rounds of the swarm (see above)."""

    kind: StalenessKind = "polynomial"
    """constant: 1; polynomial: (1+s)^-a (FedAsync); hinge: 1 up to s = b, then
    1/(a(s-b)+1); exponential: exp(-a s)."""
    a: float = 0.5
    """Decay rate of the polynomial, hinge and exponential forms."""
    b: float = 4.0
    """Hinge threshold: updates at most this stale keep full weight."""

    def __post_init__(self) -> None:
        if self.kind not in get_args(StalenessKind):
            raise ValueError(f"staleness kind must be one of {get_args(StalenessKind)}.")
        _check_finite_non_negative("staleness a", self.a)
        _check_finite_non_negative("staleness b", self.b)


def rounds_stale(staleness: int, learners: int = 1, late: int = 0) -> float:
    """Rounds of the swarm an update missed: updates applied while its round ran, beyond the
    ``learners`` - 1 others of its own round, in units of ``learners`` updates.

    ``late`` of the ``staleness`` updates were not of its round but older than its base (a
    whole swarm round or more, as its author judged them): they reached its author only after
    the round began, so its base lacked updates of the round before, and they count in full
    instead of against the M - 1 of its own round.
    """
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}.")
    if type(learners) is not int or learners < 1:
        raise ValueError(f"learners must be an integer >= 1, got {learners!r}.")
    if type(late) is not int or not 0 <= late <= staleness:
        raise ValueError(f"late must be an integer in [0, staleness], got {late!r}.")
    return (late + max(0, staleness - late - (learners - 1))) / learners


def staleness_weight(
    config: StalenessConfig, staleness: int, learners: int = 1, late: int = 0
) -> float:
    """The weight of an update ``staleness`` updates stale (``late`` of them older than its
    base, see :func:`rounds_stale`), sized by ``learners`` learners."""
    return rounds_weight(config, rounds_stale(staleness, learners, late))


def rounds_weight(config: StalenessConfig, rounds: float) -> float:
    """The weight of an update `rounds` rounds of the swarm stale."""
    if not math.isfinite(rounds) or rounds < 0:
        raise ValueError(f"rounds stale must be a finite number >= 0, got {rounds!r}.")
    s, a = rounds, config.a
    if config.kind == "constant":
        return 1.0
    if config.kind == "polynomial":
        return (1.0 + s) ** -a
    if config.kind == "hinge":
        return 1.0 if s <= config.b else 1.0 / (a * (s - config.b) + 1.0)
    return math.exp(-a * s)


@dataclass(frozen=True, kw_only=True)
class TokenWeightConfig:
    """Weights an update by the work behind it."""

    kind: TokenWeightKind = "tokens"
    """tokens: proportional to tokens processed; none: every update weighs 1."""
    reference_tokens: int
    """Tokens a full round of the run's nominal batch processes; such a round weighs 1."""

    def __post_init__(self) -> None:
        if self.kind not in get_args(TokenWeightKind):
            raise ValueError(f"token weight kind must be one of {get_args(TokenWeightKind)}.")
        if type(self.reference_tokens) is not int or self.reference_tokens <= 0:
            raise ValueError(
                f"reference_tokens must be a positive integer, got {self.reference_tokens}."
            )


def token_weight(config: TokenWeightConfig, tokens: int) -> float:
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}.")
    if config.kind == "none":
        return 1.0
    return tokens / config.reference_tokens


def _check_finite_non_negative(name: str, value: float) -> None:
    if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}.")
