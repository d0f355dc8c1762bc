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
  `send_timeout_s`; a recipient is declared lost only when every try failed (a killed
  peer fails them all within the co-sign window; a peer whose heartbeat has not expired yet
  is then found lost by the failed sends, not by its heartbeat).
- **One shard late ended a round.** `CosignClock`: when the co-sign deadline passes with the
  shards of exactly one reducer missing and that reducer alive, the deadline moves once, by
  the co-sign window (one extra deadline); two or more reducers late, or the one late again,
  abandon as before. A round therefore ends by `deadline + 2 x cosign_s` at the latest.

Not done: re-assigning a late reducer's shard to another member. Doing it by a retry without
the late member (as for a lost one) lets two different updates complete for one round id: the
late member, alive, still receives every other reducer's co-signed shard of the first attempt
and completes it, while the others complete the retry. A retry is safe only for a reducer that
cannot come back (dead: its sends all fail). Re-assigning with the included set kept would give
the same aggregate but needs the verifier to accept another member's co-signature for a shard
(a wider trust rule) and the late member's own piece of its shard, which only it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MAX_SEND_TRIES = 3
"""Tries of one piece or reduced shard to one member before giving up on it."""
RESEND_AFTER_S = 1.0
"""The pause between two tries of a failed send."""


def send_timeout_s(cosign_s: float) -> float:
    """One try's bound: every try of a shard fits in the co-sign window and its extension
    (a shard of ~0.2 MB took seconds to open a stream for at load ~40 in session 13)."""
    return max(2.0, cosign_s / 2)


@dataclass
class SendRetry:
    """One piece's or shard's tries to one member: `failed()` after a try that failed says
    whether to try again (after RESEND_AFTER_S) or give up (the member is then lost, for a
    shard whose recipient must co-sign)."""

    tries: int = 0

    def failed(self) -> bool:
        """A try failed: True to try again, False when MAX_SEND_TRIES were spent."""
        self.tries += 1
        return self.tries < MAX_SEND_TRIES


@dataclass
class CosignClock:
    """The co-sign deadline of one round, moved once by `extension_s` for one late reducer."""

    deadline: float
    extension_s: float
    extended: bool = False

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
