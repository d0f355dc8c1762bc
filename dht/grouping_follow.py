"""Follow the group: a member whose last round ended alone waits, bounded, for its group's
next round instead of opening it; pure (dht/group_exchange.py runs it).

Session 25 (docs/scale.md, phase25 (c)): after a restart or a long round one member can be
out of step with its group, opening each round alone ahead of the others (`below_quorum`
with nobody else's part, for it; `late` at once, for them, their window already run from its
part). Each such round closes only about a join window of the offset. Instead, a member
whose last round ended `below_quorum` with no other member's contribution does not open its
next round of that group at once: it waits up to `FOLLOW_WINDOWS` join windows for the
first part or piece of that round from another member (then it joins it, in the others'
window), and opens as before when none comes, or as soon as a part of a later round of the
group shows it is behind, not ahead. No new wire input, and no change to who completes a
round: the round opens as it would have had this member's part come later.
"""

from __future__ import annotations

from dataclasses import dataclass

from dht.grouping_wire import RoundId

FOLLOW_WINDOWS = 2.0
"""How many join windows a member that ended its last round alone waits for its group."""
FOLLOW_TICK_S = 0.05
"""How often a waiting member looks for its group's first part (a dict look-up)."""


def follow_s(wait_s: float) -> float:
    """The longest a member waits for its group before opening its round alone."""
    return FOLLOW_WINDOWS * wait_s


@dataclass(frozen=True)
class FollowWait:
    """One member's wait before opening round `rid`: from `since` until `until` at most."""

    rid: RoundId
    since: float
    until: float

    def ended(self, now: float, first_seen: float | None, highest_round: int) -> str | None:
        """What ends the wait now, or None (wait on): `part` (another member's part or piece
        of this round is here: join it), `group_ahead` (a part of a later round of the group
        was seen: this member is behind, not ahead) or `bound` (nobody came in time)."""
        if first_seen is not None:
            return "part"
        if highest_round > self.rid[2]:
            return "group_ahead"
        if now >= self.until:
            return "bound"
        return None


class Follower:
    """Whether this member's last round (of any group) ended alone, and so which group's next
    round it waits in."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.alone: RoundId | None = None
        """This member's last round when it ended alone; None after any other ending."""

    def ended(self, rid: RoundId, reason: str | None, contributors: frozenset[str]) -> None:
        """Round `rid` ended here: abandoned for `reason` (None: completed) with
        `contributors` in. Alone means `below_quorum` with nobody else's part."""
        lone = reason == "below_quorum" and contributors <= {self.me}
        self.alone = rid if lone else None

    def wait(
        self, rid: RoundId, now: float, first_seen: float | None, wait_s: float
    ) -> FollowWait | None:
        """The wait before this member opens round `rid` (None: open at once): only when its
        last round ended alone, in the same group and earlier, and nothing of `rid` from
        another member is here yet (`first_seen`)."""
        last = self.alone
        if last is None or last[0] != rid[0] or rid[1:] <= last[1:] or first_seen is not None:
            return None
        return FollowWait(rid, now, now + follow_s(wait_s))
