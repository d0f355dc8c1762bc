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
later census reads (dht.grouping_view.EpochGrouping._recut, session 24). Within an
epoch a list only grows (a member that dies stays listed, and is left out as any member
missing the deadline: below quorum then means members really missing), so lists that agree
stay agreed; the next epoch decides afresh from the census.

Trust: only the peer itself can add itself (its own signed header), only inside the group's
prefix (`dht.grouping.member_check`, from the peer id alone), only while alive (the caller's
liveness check) and only with a header naming this group and epoch. A non-member stays
refused; one dishonest member adds at most itself, as joining does. Pure: no network.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

MAX_KEPT = 8
"""(group key, epoch) pairs a book remembers senders for, the newest first kept."""
MAX_SENDERS = 1024
"""Senders a book keeps per (group key, epoch): a group of ~1000, far past dht.grouping's."""


class SenderBook:
    """The peers that sent this node a verified part or piece, per (group key, epoch);
    bounded (the oldest pair dropped first, a full pair takes no more)."""

    def __init__(self, max_kept: int = MAX_KEPT, max_senders: int = MAX_SENDERS) -> None:
        if max_kept < 1 or max_senders < 1:
            raise ValueError("a sender book keeps at least one pair and one sender")
        self.max_kept, self.max_senders = max_kept, max_senders
        self._seen: OrderedDict[tuple[str, int], set[str]] = OrderedDict()

    def knows(self, group_key: str, epoch: int, peer_id: str) -> bool:
        """Whether `peer_id` is booked already (the caller verifies a header only once)."""
        return peer_id in self._seen.get((group_key, epoch), ())

    def add(self, group_key: str, epoch: int, peer_id: str) -> bool:
        """Books a sender whose header the caller verified (signed, inside the group's
        prefix, alive); False when the pair is full."""
        pair = (group_key, epoch)
        senders = self._seen.get(pair)
        if senders is None:
            if len(self._seen) >= self.max_kept:
                self._seen.popitem(last=False)
            senders = self._seen[pair] = set()
        if peer_id not in senders and len(senders) >= self.max_senders:
            return False
        senders.add(peer_id)
        return True

    def senders(self, group_key: str, epoch: int) -> frozenset[str]:
        return frozenset(self._seen.get((group_key, epoch), ()))


def healed_members(
    decided: Iterable[str], senders: Iterable[str], in_group: Callable[[str], bool]
) -> tuple[str, ...]:
    """The member list of a group's next round (sorted): the epoch's decided list and every
    sender inside the group (`in_group`, a pure check from the peer id); never smaller
    than the decided list."""
    return tuple(sorted(set(decided) | {p for p in senders if in_group(p)}))
