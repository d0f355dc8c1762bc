"""How long a group round by reduce-scatter waits, and when a failed send means a lost peer;
pure (dht/grouping_shards.py and dht/group_exchange.py use it). Session 14 (docs/scale.md,
"Session 14: slow reducers, signed notices").

Session 13's runs lost most sharded rounds to `cosign_timeout` with every member in. Their
events show two causes, neither of them a dead reducer that the round noticed:

- **One failed send ended a round.** A piece whose send failed was never sent again (its
  reducer then never held every piece of its shard), and a reduced shard whose send failed
  made the sender declare the recipient lost at once and retry without it, while the others
  (which reached it) went on with the first included set: the sender and the rest then waited
  for co-signatures over two different sets. `SendRetry`: a failed piece or shard is sent
  again after `RESEND_AFTER_S`, `MAX_SEND_TRIES` tries in all, each bounded by
  `send_timeout_s`; a recipient was declared lost only when every try failed (since session
  18, never by failed sends: below).
- **One shard late ended a round.** `CosignClock`: when the co-sign deadline passes with the
  shards of exactly one reducer missing and that reducer alive, the deadline moves once, by
  the co-sign window (one extra deadline); two or more reducers late, or the one late again,
  abandon as before. A round therefore ends by `deadline + 2 x cosign_s` at the latest
  (the deadline `collect_s` after the round's first message, session 18).

Session 18 ("Session 18: group rounds that complete at 16 nodes"): at 16 nodes on 2 cores
half the sharded rounds still ended `cosign_timeout`, nearly all with every member in, for two
reasons that made members co-sign different included sets (a round completes only when every
included member co-signs one set):

- **A member that joined in the last second of the window.** Each member closes its round at
  its own deadline (`wait_s` after the round's first piece was here), with whoever's pieces
  came by then. A member that finished training just before its deadline sent its pieces
  then, and they reached some members before their deadline and others after it: two
  included sets. A member still joins until its window is over (`joins_in_time`; later it
  stays out, `late`, its contribution carried to its next round by merge.group_carry), but
  every member keeps collecting `grace_s` longer (`collect_s`): what a piece takes to arrive
  plus how far apart members' deadlines are, so a part sent in time reaches every member
  before it closes. A round with every member in still closes at once.
- **A live reducer declared lost on one member's word.** A member that found a reducer missing
  its shard and "not alive" in its own live view retried without it at once, alone; under
  load those views flap (a peer missed for a heartbeat or two), so the live reducer's shard
  came a moment later over the set the others kept. `CosignClock.losses`: the live view may
  declare a reducer lost only once the first co-sign deadline has passed (every live reducer
  had a whole window); the retry then gets the one extra window (`retried`).
- **A live member declared lost by failed sends.** Session 14 made a shard's recipient lost
  once every `SendRetry` try failed. Under load a live member's streams fail for seconds (a
  process without the CPU: this session's after-run, `groups.0b01` round 4, node6's shard
  reached nobody for 10 s, then everyone); its senders retried without it alone, again two
  included sets. Failed sends are now tried again while the round lasts (`SendRetry` with
  `until`: its streams came back at ~+14 s, inside the window) and never make the member
  lost: a dead member is lost by the live view past the first co-sign deadline, and a live
  member that never got a shard is told of the completed update (`group-done`) and adopts
  it.

Not done: re-assigning a late reducer's shard to another member. Doing it by a retry without the
late member (as for a lost one) lets two different updates complete for one round id: the late
member, alive, still receives every other reducer's co-signed shard of the first attempt and
completes it, while the others complete the retry. A retry is safe only for a reducer that cannot
come back (dead: gone from every live view by the co-sign deadline). Re-assigning with the included
set kept would give the same aggregate but needs the verifier to accept another member's
co-signature for a shard (a wider trust rule) and the late member's own piece of its shard, which
only it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

GRACE_SHARE = 0.25
"""How long past its join window a member keeps collecting pieces, as a share of the window."""
MIN_GRACE_S = 1.0
MAX_GRACE_S = 5.0
"""Bounds of that grace: it covers a piece's delivery and the spread of members' deadlines
(at 16 nodes under load: delivery p95 0.6-0.8 s, deadlines p90 0.8-1.1 s apart), which do not
grow with the window."""
MAX_SEND_TRIES = 3
"""Tries of one message to one member before giving up on it, where no deadline bounds them."""
RESEND_AFTER_S = 1.0
"""The pause between two tries of a failed send."""


def send_timeout_s(cosign_s: float) -> float:
    """One try's bound: every try of a shard fits in the co-sign window and its extension
    (a shard of ~0.2 MB took seconds to open a stream for at load ~40 in session 13)."""
    return max(2.0, cosign_s / 2)


def grace_s(wait_s: float) -> float:
    """How long past a `wait_s` join window a member keeps collecting its group's pieces."""
    return min(max(GRACE_SHARE * wait_s, MIN_GRACE_S), MAX_GRACE_S, wait_s / 2)


def collect_s(wait_s: float) -> float:
    """A round's collection window, from the round's first message here: the join window and
    the grace for parts sent within it (a member not in by then is left out)."""
    return wait_s + grace_s(wait_s)


def round_deadlines(
    opened_at: float, wait_s: float, cosign_s: float, grace_s: float
) -> tuple[float, float]:
    """A round's close (its join window and the grace past it) and its first co-sign deadline
    (`cosign_s` past the join window, at least the close), so a round ends within the same
    bound with or without a grace."""
    return opened_at + wait_s + grace_s, opened_at + wait_s + max(cosign_s, grace_s)


def joins_in_time(now: float, first_seen: float | None, wait_s: float) -> bool:
    """Whether a member whose own part is ready at `now` joins the round whose first message
    (another member's part or piece) was here at `first_seen` (None: none yet, it opens the
    round): while its `wait_s` join window lasts. Its pieces then reach every other member
    within `collect_s`, as long as delivery and the spread of members' windows stay within
    `grace_s`."""
    return first_seen is None or now - first_seen < wait_s


@dataclass
class SendRetry:
    """One piece's or shard's tries to one member: `failed()` after a try that failed says
    whether to try again (after RESEND_AFTER_S) or give up. With `until` (the round's co-sign
    deadline, read at each failure: it may move) it tries again while the round can still
    use the message (session 18); without, MAX_SEND_TRIES tries in all. Giving up never
    makes the member lost (session 18: the live view does that, past the deadline)."""

    tries: int = 0

    def failed(self, now: float = 0.0, until: float | None = None) -> bool:
        """A try failed at `now`: True to try again."""
        self.tries += 1
        if until is not None:
            return now + RESEND_AFTER_S < until
        return self.tries < MAX_SEND_TRIES


@dataclass
class CosignClock:
    """The co-sign deadline of one round, moved once by `extension_s` for one late reducer."""

    deadline: float
    extension_s: float
    extended: bool = False
    first_deadline: float = -1.0
    """The co-sign deadline before any move (set from `deadline`)."""

    def __post_init__(self) -> None:
        if self.first_deadline < 0:
            self.first_deadline = self.deadline

    def losses(self, now: float, missing: Sequence[str], alive: Callable[[str], bool]) -> list[str]:
        """The reducers (of `missing`) this member's live view may declare lost now: those
        not alive, once the first co-sign deadline has passed (before it, a reducer missing
        from a flapping view is waited for: its shard may be on its way)."""
        if now < self.first_deadline:
            return []
        return [m for m in missing if not alive(m)]

    def retried(self) -> None:
        """The round retried without reducers lost past the first deadline: its new attempt
        gets the one extra window (not a second one)."""
        if not self.extended:
            self.extended = True
            self.deadline += self.extension_s

    def expired(self, now: float, missing: Sequence[str], alive: Callable[[str], bool]) -> bool:
        """Whether the round abandons now: past the deadline with shards missing (`missing`:
        their reducers), unless exactly one live reducer is late and the deadline was not
        moved yet (then it moves, once)."""
        if now < self.deadline or not missing:
            return False
        if not self.extended and len(missing) == 1 and alive(missing[0]):
            self.extended = True
            self.deadline += self.extension_s
            return now >= self.deadline
        return True
