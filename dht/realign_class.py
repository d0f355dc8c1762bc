"""A group member left out of its group's fetch round realigns from the round's class
(`--group-shard-fetch`; docs/scale.md, Session 22).

A fetch round runs among the largest class of its members at one base and one state
(merge.shard_fetch `compose`); a member outside it falls back alone (`left_out_state`,
`left_out_base`) and, before this, stayed apart: replicas of one applied set applied in
other orders differ for ~40 folds (session 18), and its fallback, applied whole where the
class applied by shards, moved it further. Session 20 (16 nodes, four groups of four): 54 of
279 member fetch rounds left a member out and 32 had no class at all.

The decision (pure, no network, no clock: the caller passes `now`):

- **When.** A member left out of a composed round (a class of two or more) notes the class
  (`left_out`); at the start of its next fetch round, once its own group's update is applied
  (the donor's previous round is over by then: one training round lies between), it
  downloads a class member's state (`decide`) and proposes from it, so that round has it
  back. A round where it was in the class clears the note (`aligned`).
- **From whom.** Only a class that is a strict majority of the round's members (signed
  proposals at one base and one state, merge.shard_fetch `Proposal`): a liar that copies an
  honest member's blocks makes a class of two, which in a round of three or more is no
  majority of four and ties nothing in; in a round of three it is one, and the state it then
  serves still passes the newcomer's checks (dht.state_check) or loads nothing. The donor is
  a class member still in the next round, the left-out members spread over the class by
  their rank (a donor serves two downloads at once, dht.state_parts); never this node.
- **How often.** At most `max_attempts` per `window_s`, `cooldown_s` after any attempt: a
  member that keeps coming apart (or a class that keeps leaving it out) costs at most that
  many state downloads (about three fp32 models each), never one a round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

REASONS = ("left_out_state", "left_out_base")
"""Why a member may be left out of a composed round (merge.shard_fetch `left_out`)."""


@dataclass(frozen=True, kw_only=True)
class ClassRealignConfig:
    """How often a member left out of its group's class may download a class member's state."""

    max_attempts: int = 4
    """State downloads per `window_s` at most."""
    window_s: float = 600.0
    """The window `max_attempts` counts in."""
    cooldown_s: float = 30.0
    """Least time between two attempts."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts!r}.")
        for name in ("window_s", "cooldown_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}.")


@dataclass(frozen=True)
class LeftOut:
    """The class a fetch round ran among without this member, and why it was left out."""

    members: tuple[str, ...]
    """The round's members (sorted)."""
    cls: tuple[str, ...]
    """The class the round ran among (sorted)."""
    reason: str


def is_majority(cls: Sequence[str], members: Sequence[str]) -> bool:
    """Whether `cls` (two or more of `members`) is more than half of them."""
    inside = set(cls) & set(members)
    return len(inside) >= 2 and 2 * len(inside) > len(set(members))


def donor_for(left: LeftOut, self_id: str, now_members: Sequence[str]) -> str | None:
    """The class member this node downloads from: among those still in the next round
    (`now_members`), the one at this node's rank among the left-out members (modulo), so two
    left out download from two donors; None: no class member left, or no majority."""
    if self_id in left.cls or not is_majority(left.cls, left.members):
        return None
    present = set(now_members)
    donors = sorted(m for m in left.cls if m in present and m != self_id)
    if not donors:
        return None
    apart = sorted(m for m in left.members if m not in left.cls)
    rank = apart.index(self_id) if self_id in apart else 0
    return donors[rank % len(donors)]


@dataclass
class ClassRealign:
    """One member's notes of the class it was left out of and its attempts; not thread-safe
    (the fetch rounds' coroutine, one round at a time, owns it)."""

    self_id: str
    config: ClassRealignConfig = field(default_factory=ClassRealignConfig)
    _left: LeftOut | None = None
    _attempts: list[float] = field(default_factory=list)
    _last: float | None = None
    num_attempts: int = 0
    num_loaded: int = 0

    def left_out(self, cls: Sequence[str], members: Sequence[str], reason: str) -> None:
        """A composed round ran among `cls` without this node (`reason`: REASONS)."""
        if reason not in REASONS or self.self_id in cls:
            return
        self._left = LeftOut(tuple(sorted(members)), tuple(sorted(cls)), reason)

    def aligned(self) -> None:
        """A round ran with this node in its class: nothing to realign for."""
        self._left = None

    @property
    def pending(self) -> LeftOut | None:
        return self._left

    def due(self, now: float) -> bool:
        """Whether the note taken last (`left_out`) will be acted on at the next round if
        its class is still there: a majority class, a donor in it, and the cap and the
        cooldown allow one at `now` (and so at any later time). The left-out member then
        fetches none of the round's updates whole: the class's state brings them."""
        left = self._left
        if left is None or donor_for(left, self.self_id, left.members) is None:
            return False
        return self._may_attempt(now)

    def decide(self, members: Sequence[str], now: float) -> tuple[str, LeftOut] | None:
        """At the start of a fetch round among `members`: (donor, the class left out of) when
        this node downloads a class member's state now, else None. The note is spent either
        way (the next left-out writes a new one); an attempt counts from `now`."""
        left, self._left = self._left, None
        if left is None:
            return None
        donor = donor_for(left, self.self_id, members)
        if donor is None or not self._may_attempt(now):
            return None
        self._attempts.append(now)
        self._last = now
        self.num_attempts += 1
        return donor, left

    def finished(self, *, loaded: bool) -> None:
        self.num_loaded += loaded

    def _may_attempt(self, now: float) -> bool:
        window = now - self.config.window_s
        self._attempts = [t for t in self._attempts if t > window]
        if len(self._attempts) >= self.config.max_attempts:
            return False
        return self._last is None or now - self._last >= self.config.cooldown_s
