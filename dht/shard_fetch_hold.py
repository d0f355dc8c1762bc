"""What the gossip may fetch whole while this node runs fetch rounds (`--group-shard-fetch`),
decided without a network or a clock of its own (dht.group_exchange_candidates acts on it;
docs/scale.md, Session 23).

Another group's update reaches a member by a fetch round (with every member of its group, at
one moment: one state) or whole through the gossip (at a moment of its own: the members stand
on other states at the next round, `state_differs`, and every later round falls back). So:

- every other group's update the gossip wants becomes a candidate of the next fetch round,
  named by a `group-done` notice or not (then with the gossip's live sources as holders:
  session 22's 77 notices refused as too far left ids no round could take);
- a candidate waits for a round until its hand-over time (`FALLBACK_ROUNDS` group waits
  after its notice, `UNNOTICED_ROUNDS` after the gossip first wanted it if no notice named
  it), then goes to the gossip's whole fetch: nothing wanted is dropped;
- one a round left (not every member proposed it) stays a candidate of the next round
  rather than going to the gossip at once;
- one handed over while a fetch round is open here waits until that round ends, at most
  `IN_ROUND_WAITS` group waits: a replica that moves under an open round ends it;
- each hand-over names its cause (the `update_fetched` event's).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from dht.grouping import key_prefix
from merge.shard_fetch import MAX_CANDIDATES, UpdateId

FALLBACK_ROUNDS = 3.0
"""A candidate a notice named and no round applied goes to the gossip this many group waits
after its notice."""
UNNOTICED_ROUNDS = 1.0
"""Group waits an update no notice named waits for a round (session 18: a group ahead whose
notices are refused publishes faster than three waits of retention allow)."""
IN_ROUND_WAITS = 1.0
"""Group waits an update handed over while a fetch round is open here waits for it to end."""
MAX_TRACKED = 16 * MAX_CANDIDATES


@dataclass
class _Hold:
    due: float
    """When it goes to the gossip if no round applied it."""
    noticed: bool
    """A `group-done` notice named it (else the gossip wanted it first)."""
    since: float


@dataclass(frozen=True)
class Verdict:
    held: bool
    """The gossip waits before fetching it whole."""
    adopt: bool = False
    """It is no candidate yet and has sources: make it one (holders: the sources)."""


class HoldBook:
    """Per other group's update: held for a fetch round, handed over, and why."""

    def __init__(self) -> None:
        self.holding = True
        """Whether this node runs fetch rounds (False once it lingers or leaves: no holds)."""
        self._own_keys: OrderedDict[str, None] = OrderedDict()
        self._holds: OrderedDict[UpdateId, _Hold] = OrderedDict()
        self._released: OrderedDict[UpdateId, tuple[str, float]] = OrderedDict()
        self._round_open_since: float | None = None
        self._last_round_at: float | None = None

    # ---- what the exchange tells it ---------------------------------------------------------

    def own_key(self, group_key: str) -> None:
        self._own_keys[group_key] = None
        self._own_keys.move_to_end(group_key)
        while len(self._own_keys) > 64:
            self._own_keys.popitem(last=False)

    def noticed(self, uid: UpdateId, now: float, wait_s: float) -> None:
        """A notice named `uid`: it waits FALLBACK_ROUNDS group waits from the first notice."""
        hold = self._holds.get(uid)
        if uid in self._released:
            return
        if hold is None or not hold.noticed:
            since = now if hold is None else hold.since
            self._track(uid, _Hold(now + FALLBACK_ROUNDS * wait_s, True, since))

    def round_opened(self, now: float) -> None:
        self._round_open_since = now
        self._last_round_at = now

    def round_closed(self) -> None:
        self._round_open_since = None

    def applied(self, uid: UpdateId) -> None:
        """A round (or its in-order fallback) applied `uid`: nothing more to hold."""
        self._holds.pop(uid, None)

    def release(self, uid: UpdateId, now: float, cause: str) -> None:
        """`uid` goes to the gossip now, for `cause` (once: a second hand-over keeps the first's
        time and cause)."""
        self._holds.pop(uid, None)
        if uid in self._released:
            return
        self._released[uid] = (cause, now)
        self._released.move_to_end(uid)
        while len(self._released) > MAX_TRACKED:
            self._released.popitem(last=False)

    # ---- what it decides ----------------------------------------------------------------------

    def verdict(self, uid: UpdateId, sources: tuple[str, ...] | list[str], now: float,
                wait_s: float) -> Verdict:  # fmt: skip
        """Whether the gossip waits before fetching `uid` whole (see the module's docstring)."""
        if not self.holding or key_prefix(uid[0]) is None or uid[0] in self._own_keys:
            return Verdict(False)
        released = self._released.get(uid)
        if released is not None:
            return Verdict(self._in_round_hold(released[1], now, wait_s))
        hold = self._holds.get(uid)
        if hold is None:
            hold = self._track(uid, _Hold(now + UNNOTICED_ROUNDS * wait_s, False, now))
        if now >= hold.due:  # released as of its hand-over time, however late asked
            self.release(uid, hold.due, self.cause_due(uid))
            return Verdict(self._in_round_hold(hold.due, now, wait_s))
        return Verdict(True, adopt=not hold.noticed and bool(sources))

    def due(self, uid: UpdateId) -> float | None:
        """When `uid` goes to the gossip (None: not held)."""
        hold = self._holds.get(uid)
        return None if hold is None else hold.due

    def cause_due(self, uid: UpdateId) -> str:
        """Why `uid`, past its hand-over time, goes: `timer` (a fetch round ran here since it
        was wanted, none applied it), `timer_no_round` (none ran here: this node was in no
        completed round), `unnoticed_` before either when no notice named it."""
        hold = self._holds.get(uid)
        if hold is None:
            return "timer"
        ran = self._last_round_at is not None and self._last_round_at >= hold.since
        return ("" if hold.noticed else "unnoticed_") + ("timer" if ran else "timer_no_round")

    def cause(self, uid: UpdateId) -> str | None:
        released = self._released.get(uid)
        return None if released is None else released[0]

    def num_tracked(self) -> int:
        return len(self._holds) + len(self._released) + len(self._own_keys)

    # ---- internals ----------------------------------------------------------------------------

    def _in_round_hold(self, released_at: float, now: float, wait_s: float) -> bool:
        opened = self._round_open_since
        return opened is not None and now - released_at < IN_ROUND_WAITS * wait_s

    def _track(self, uid: UpdateId, hold: _Hold) -> _Hold:
        self._holds[uid] = hold
        while len(self._holds) > MAX_TRACKED:
            self._holds.popitem(last=False)
        return hold
