"""Member lists that differ heal once the members read each other (session 24, docs/scale.md):
the epoch's decided list grows with the peers of the group a later census reads
(dht.grouping_view.EpochGrouping._recut), and is joined by the signed senders
(dht.grouping_census.healed_members). bits24's 16-node run: node6's and node14's first
censuses each missed the other (read 4 s after their epoch's first decision), the other two
members listed all four, so neither ever sent to the other and both kept 3-member lists for
the whole epoch (8 `below_quorum` of 9 rounds each)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import Grouping, GroupingConfig, member_check
from dht.grouping_census import SenderBook, healed_members
from dht.grouping_view import EpochGrouping
from tests.unit.test_swarm_pages import peer_id

RUN = "run-heal"
CONFIG = GroupingConfig(min_group_size=4, max_bits=4)


class Member:
    """One member's grouping and sender book, run as GroupPublishing runs them: each round
    it decides from its census, and its list is the decision joined by its senders."""

    def __init__(self, me: str) -> None:
        self.me = me
        self.grouping = EpochGrouping(RUN, 10, CONFIG, me=me)
        self.book = SenderBook()
        self.key: str | None = None
        self.list: tuple[str, ...] = ()

    def decide(self, round_: int, census: list[str], announced: dict[str, object]) -> None:
        grouping = self.grouping.decide(round_, census, announced)
        if grouping is None:  # waits for its census to bear its peers' split
            self.key, self.list = None, ()
            return
        key = grouping.group_of(self.me)
        assert key is not None
        epoch = self.grouping.epoch_of(round_)
        senders = self.book.senders(key, epoch)
        self.key = key
        self.list = healed_members(grouping.members[key], senders, member_check(RUN, key))


def exchange(members: dict[str, Member], epoch: int) -> None:
    """One exchange: each member sends its part to the members of its own list, each books
    the senders of its own group key (the exchange checks the key and prefix)."""
    for sender in members.values():
        for receiver in sender.list:
            other = members.get(receiver)
            if other is not None and receiver != sender.me and other.key == sender.key:
                assert sender.key is not None
                other.book.add(sender.key, epoch, sender.me)


def whole(peers: list[str]) -> Grouping:
    grouping = EpochGrouping(RUN, 10, CONFIG, me="observer").decide(0, peers)
    assert grouping is not None
    return grouping


def test_two_members_whose_first_censuses_missed_each_other_heal_once_they_read_them() -> None:
    """The session-24 case: A's census missed B and B's missed A at the epoch's first round;
    the group's other members listed both. One exchange leaves A and B apart (neither sends
    to the other); the round after their censuses read each other, all hold one list."""
    peers = [peer_id(i) for i in range(40)]
    full = whole(peers)
    key, group = next((k, g) for k, g in full.members.items() if len(g) >= 4)
    a, b = group[0], group[1]
    announced: dict[str, object] = dict.fromkeys(peers, full.bits)
    members = {p: Member(p) for p in group}
    for p, m in members.items():
        m.decide(0, [q for q in peers if q != {a: b, b: a}.get(p)], announced)
    exchange(members, 0)
    assert members[a].list != members[b].list and b not in members[a].list
    for m in members.values():  # the next round's censuses read every peer
        m.decide(1, peers, announced)
    assert {m.list for m in members.values()} == {group}
    assert {m.key for m in members.values()} == {key}


@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(12, 60),
    missed=st.floats(0.0, 0.4),
    seed=st.integers(0, 10_000),
)
def test_members_whose_lists_differ_converge_within_one_round_once_they_read_each_other(
    size: int, missed: float, seed: int
) -> None:
    """Every member's first census misses peers at random (never itself); from the first
    round at which every census reads every peer, every member of a group holds the full
    census's list for it, and an exchange then changes nothing (agreed lists stay agreed)."""
    rng = random.Random(seed)
    peers = [peer_id(rng.randrange(100_000)) for _ in range(size)]
    peers = sorted(set(peers))
    full = whole(peers)
    announced: dict[str, object] = dict.fromkeys(peers, full.bits)
    members = {p: Member(p) for p in peers}
    for p, m in members.items():
        m.decide(0, [q for q in peers if q == p or rng.random() >= missed], announced)
    exchange(members, 0)
    for m in members.values():
        m.decide(1, peers, announced)
    for p, m in members.items():
        key = full.group_of(p)
        assert key is not None and m.key == key and m.list == full.members[key]
    exchange(members, 0)
    for m in members.values():
        m.decide(2, peers, announced)
        assert m.list == full.members[m.key or ""]


@settings(max_examples=40, deadline=None)
@given(
    size=st.integers(12, 60),
    seen=st.floats(0.0, 1.0),
    seed=st.integers(0, 10_000),
)
def test_a_restarted_member_rejoins_its_groups_list_within_two_rounds(
    size: int, seen: float, seed: int
) -> None:
    """A member restarted mid-epoch (its grouping and book lost) whose first census read only
    some peers holds its group's list, the same as every other member's, by the second round
    after its restart: the others list it (same peer id), so it hears from all of them, and
    its census reads the rest."""
    rng = random.Random(seed)
    peers = sorted({peer_id(rng.randrange(100_000)) for _ in range(size)})
    full = whole(peers)
    announced: dict[str, object] = dict.fromkeys(peers, full.bits)
    members = {p: Member(p) for p in peers}
    for m in members.values():
        m.decide(0, peers, announced)
    me = rng.choice(peers)
    members[me] = Member(me)  # restarted at round 5
    members[me].decide(5, [q for q in peers if q == me or rng.random() < seen], announced)
    for m in members.values():
        if m.me != me:
            m.decide(5, peers, announced)
    exchange(members, 0)
    for m in members.values():
        m.decide(6, peers, announced)
    key = full.group_of(me)
    assert key is not None
    assert {members[p].list for p in full.members[key]} == {full.members[key]}
