"""One member list per group and epoch: lists that differ heal within one round (session 13).

Each node decides its epoch's grouping from its own census (dht.grouping_view.EpochGrouping),
and while nodes join or restart the censuses differ: a node that read only part of the
heartbeats leaves a member out, a newcomer is in nobody's list yet. A member list that
differs costs the whole epoch: parts from a peer outside a node's list are refused
(`group_part_not_a_member`) and with --group-scatter a part's split is fixed by its sender's
list, so its pieces are refused outright (`group_piece_wrong_shards`).

The evidence that heals it is already on the wire: a member sends its part (or its pieces)
to exactly the members of its own list, each under its signed header naming the group key
and epoch. So a verified part from a peer P inside the group's prefix says "P is alive, in
this group, and lists me". `SenderBook` keeps, per (group key, epoch), the peers that sent
this node such a part, and `healed_members` is the list a node runs its next round with:
its decided list joined by those senders. After one exchange, two members i and j hold the
same list whenever, for every member k, one of i and k and one of j and k listed the other
(`test_one_exchange_heals_lists_that_differ_by_late_or_partial_censuses`): a newcomer lists
everyone and is heard by everyone; a node whose census missed k is sent to by k. Two members
that each missed the other are sent to by neither: their decided lists grow with the peers a
later census reads (dht.grouping_view.EpochGrouping._recut, session 24). The decided list
only grows within an epoch; the next epoch decides afresh from the census.

A member silent on both channels leaves the round's list (`audible_members`, session 25): a
listed peer that is in none of this node's census (no heartbeat within the census window, 30
s) and sent this node no part or piece of this group's epoch for `QUIET_ROUNDS` rounds (of
the epoch: none is dropped in its first `QUIET_ROUNDS` rounds) is left out of the round's
list. A member dead at some members' decision was listed by those for the whole epoch while
the others (a restarted member among them) never added it, and with --group-scatter their
splits refused each other's pieces until the next epoch; a dead member goes silent on every
member alike, so after the census window and `QUIET_ROUNDS` rounds no member lists it. The
filter holds no state: a member that speaks again (a heartbeat read, a part received) is
listed again at the next round, so a member dropped by one node's lagging reads comes back
as soon as one message of its own arrives.

Trust of the drop: only this node's own observations of the peer's own messages count (its signed
heartbeat in the census, its part or piece whose sender the transport authenticated), never
what another member says about it, so a rogue cannot drop an honest live member from anyone's
list by lying: that member heartbeats and sends its own parts. A rogue can make its own
silence uneven (send to some members and not to others, and stop its heartbeat) and so split
the lists for `QUIET_ROUNDS` rounds, no more than it can already void its group's rounds by
withholding its own shard. Nothing is added to the wire: a mixed swarm's old members keep a
dead member listed all epoch as before, so in a group of both releases the new members agree
with each other and with the ones that never listed it, the old ones with each other.

Trust: only the peer itself can add itself (its own signed header), only inside the group's
prefix (`dht.grouping.member_check`, from the peer id alone), only while alive (the caller's
liveness check) and only with a header naming this group and epoch. A non-member stays
refused; one dishonest member adds at most itself, as joining does. Pure: no network.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping

MAX_KEPT = 8
"""(group key, epoch) pairs a book remembers senders for, the newest first kept."""
QUIET_ROUNDS = 2
"""Rounds a listed peer absent from the census must have sent this node nothing in (its last
part or piece before round r - QUIET_ROUNDS) before round r's list leaves it out: the parts
of round r are not here when r's list is made, and a member that died sending r - 1's part
to some members only is heard by those for r and r + 1."""
MAX_SENDERS = 1024
"""Senders a book keeps per (group key, epoch): a group of ~1000, far past dht.grouping's."""


class SenderBook:
    """The peers that sent this node a verified part or piece, per (group key, epoch);
    bounded (the oldest pair dropped first, a full pair takes no more)."""

    def __init__(self, max_kept: int = MAX_KEPT, max_senders: int = MAX_SENDERS) -> None:
        if max_kept < 1 or max_senders < 1:
            raise ValueError("a sender book keeps at least one pair and one sender")
        self.max_kept, self.max_senders = max_kept, max_senders
        self._seen: OrderedDict[tuple[str, int], dict[str, int]] = OrderedDict()
        """(group key, epoch) -> sender -> the highest round it sent this node a message of."""

    def knows(self, group_key: str, epoch: int, peer_id: str) -> bool:
        """Whether `peer_id` is booked already (the caller verifies a header only once)."""
        return peer_id in self._seen.get((group_key, epoch), ())

    def add(self, group_key: str, epoch: int, peer_id: str, round_: int = 0) -> bool:
        """Books a sender whose header the caller verified (signed, inside the group's
        prefix, alive) for its message of `round_`; False when the pair is full."""
        pair = (group_key, epoch)
        senders = self._seen.get(pair)
        if senders is None:
            if len(self._seen) >= self.max_kept:
                self._seen.popitem(last=False)
            senders = self._seen[pair] = {}
        if peer_id not in senders and len(senders) >= self.max_senders:
            return False
        senders[peer_id] = max(senders.get(peer_id, round_), round_)
        return True

    def heard(self, group_key: str, epoch: int, peer_id: str, round_: int) -> None:
        """A booked sender's later message (the transport authenticated its sender, the
        header is its own): its round, kept when higher; nothing for a sender not booked."""
        senders = self._seen.get((group_key, epoch))
        if senders is not None and peer_id in senders:
            senders[peer_id] = max(senders[peer_id], round_)

    def senders(self, group_key: str, epoch: int) -> frozenset[str]:
        return frozenset(self._seen.get((group_key, epoch), ()))

    def rounds(self, group_key: str, epoch: int) -> dict[str, int]:
        """The pair's senders and the highest round each sent this node a message of."""
        return dict(self._seen.get((group_key, epoch), {}))


def healed_members(
    decided: Iterable[str], senders: Iterable[str], in_group: Callable[[str], bool]
) -> tuple[str, ...]:
    """The member list of a group's next round (sorted): the epoch's decided list and every
    sender inside the group (`in_group`, a pure check from the peer id); never smaller
    than the decided list."""
    return tuple(sorted(set(decided) | {p for p in senders if in_group(p)}))


def audible_members(
    listed: Iterable[str],
    me: str,
    census: Collection[str],
    last_heard: Mapping[str, int],
    round_: int,
    first_round: int,
    quiet_rounds: int = QUIET_ROUNDS,
) -> tuple[str, ...]:
    """Round `round_`'s member list (sorted): `listed` less the peers silent on both channels
    here, neither in this node's `census` (a heartbeat within the census window) nor heard
    from (`last_heard`: sender -> the highest round of its part or piece of this group's
    epoch) since round `round_ - quiet_rounds`. This node always stays, and so does every
    listed peer until `quiet_rounds` rounds of the epoch (its first is `first_round`) have
    passed: silence is counted within the epoch only, and a census that missed a live peer
    at the epoch's start does not drop it before it could be heard."""
    since = round_ - quiet_rounds
    if since < first_round:
        return tuple(sorted(set(listed)))
    return tuple(
        sorted(
            p
            for p in set(listed)
            if p == me or p in census or last_heard.get(p, since - 1) >= since
        )
    )
