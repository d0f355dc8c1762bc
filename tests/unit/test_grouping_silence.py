"""A member silent on both channels leaves the round's list (dht/grouping_census.py
`audible_members`, session 25). rounds24's 16-node run: node12 died before its group's
epoch decision; four members listed it (their census keeps a peer 30 s), three did not, and
with --group-scatter the 7- and 8-member splits refused each other's pieces until node12
came back; node13-1, restarted, decided without node1 (dead), which the others kept listed
all epoch. Lists only grew within an epoch, so nothing healed them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import Grouping
from dht.grouping_census import QUIET_ROUNDS, SenderBook, audible_members, healed_members
from node.group_publishing import GroupPublishing
from tests.node.test_runtime import offline_node
from tests.unit.test_grouping_census import _exchange_node, _grouped, _header

KEY, EPOCH = "groups.0b1", 0


def _in_group(peer: str) -> bool:
    return True


class Member:
    """One member as node.group_publishing runs it: its epoch's decided list, its sender
    book, and each round's list (decided, joined by the senders, less the silent)."""

    def __init__(self, me: str, decided: set[str], *, silence: bool = True) -> None:
        self.me, self.decided, self.silence = me, frozenset(decided | {me}), silence
        self.book = SenderBook()
        self.list: tuple[str, ...] = ()

    def decide(self, round_: int, census: set[str]) -> tuple[str, ...]:
        healed = healed_members(self.decided, self.book.senders(KEY, EPOCH), _in_group)
        rounds = self.book.rounds(KEY, EPOCH)
        self.list = (
            audible_members(healed, self.me, census | {self.me}, rounds, round_, 0)
            if self.silence
            else healed
        )
        return self.list

    def receive(self, sender: str, round_: int) -> None:
        """A part or piece of `sender`'s own (the transport names the sender)."""
        if self.book.knows(KEY, EPOCH, sender):
            self.book.heard(KEY, EPOCH, sender, round_)
        else:
            self.book.add(KEY, EPOCH, sender, round_)


def _send(members: dict[str, Member], sender: str, to: tuple[str, ...], round_: int) -> None:
    for receiver in to:
        if receiver != sender and receiver in members:
            members[receiver].receive(sender, round_)


def _run_dead_member(
    silence: bool, lag: dict[str, int], got_last_part: set[str], rounds: int = 8
) -> list[dict[str, tuple[str, ...]]]:
    """Members a-d; `dead` sent its round-0 part to `got_last_part` and died; a and b
    decided with it, c and d without (c restarted after it died). `lag`: rounds the dead
    member's heartbeat stays in each member's census (read lag, within the census window).
    Returns each round's lists."""
    live = ["a", "b", "c", "d"]
    members = {
        "a": Member("a", set(live) | {"dead"}, silence=silence),
        "b": Member("b", set(live) | {"dead"}, silence=silence),
        "c": Member("c", set(live), silence=silence),
        "d": Member("d", set(live), silence=silence),
    }
    _send(members, "dead", tuple(sorted(got_last_part)), 0)
    history = []
    for round_ in range(rounds):
        for m in members.values():
            census = set(live) | ({"dead"} if round_ <= lag.get(m.me, 0) else set())
            m.decide(round_, census)
        for m in members.values():
            _send(members, m.me, m.list, round_)
        history.append({m.me: m.list for m in members.values()})
    return history


def test_a_dead_member_listed_by_some_leaves_every_list_within_quiet_rounds() -> None:
    """Without the rule a and b list the dead member all epoch while c and d do not (their
    splits refuse each other's pieces); with it all four hold one list from round
    QUIET_ROUNDS + 1 on (the dead member's last part reached a at round 0)."""
    lag = {"a": 1, "b": 2}
    before = _run_dead_member(False, lag, {"a"})
    assert all(len(set(lists.values())) == 2 for lists in before)
    after = _run_dead_member(True, lag, {"a"})
    agreed = [len(set(lists.values())) == 1 for lists in after]
    assert agreed == [False] * (QUIET_ROUNDS + 1) + [True] * (len(after) - QUIET_ROUNDS - 1)
    assert set(after[-1].values()) == {("a", "b", "c", "d")}


@settings(max_examples=80, deadline=None)
@given(
    lag=st.dictionaries(st.sampled_from("abcd"), st.integers(0, 3)),
    got=st.sets(st.sampled_from("abcd")),
)
def test_members_whose_lists_differ_by_a_dead_member_agree_within_r_rounds(
    lag: dict[str, int], got: set[str]
) -> None:
    """Whoever listed the dead member, received its last part or read its heartbeat late
    (up to three rounds, the census window at ~10 s rounds): from round
    max(QUIET_ROUNDS, lag) + 1 every live member holds the live members' list, and no live
    member ever leaves any list."""
    history = _run_dead_member(True, lag, got)
    settled = max(QUIET_ROUNDS, *lag.values(), 0) + 1
    for round_, lists in enumerate(history):
        assert all({"a", "b", "c", "d"} <= set(listed) for listed in lists.values())
        if round_ >= settled:
            assert set(lists.values()) == {("a", "b", "c", "d")}


@settings(max_examples=80, deadline=None)
@given(
    sends=st.lists(st.sets(st.sampled_from("abcd")), min_size=6, max_size=6),
    claims=st.lists(st.integers(-5, 50), min_size=6, max_size=6),
    beats=st.lists(st.sets(st.sampled_from("abcd")), min_size=6, max_size=6),
    missed=st.lists(st.sets(st.sampled_from("abcd")), min_size=6, max_size=6),
)
def test_a_rogue_drops_no_live_honest_member_from_any_list(
    sends: list[set[str]], claims: list[int], beats: list[set[str]], missed: list[set[str]]
) -> None:
    """A rogue member of the group sends its parts to whom it likes, claims any round in its
    own headers and heartbeats to whom it likes; honest members' heartbeats are missed by
    some censuses in some rounds (`missed`: the members whose census misses every honest
    peer that round). No honest member ever leaves an honest member's list: what keeps
    it listed is its own heartbeat and its own parts, which the rogue cannot take away."""
    honest = ["a", "b", "c", "d"]
    members = {p: Member(p, set(honest) | {"rogue"}) for p in honest}
    for round_ in range(6):
        for m in members.values():
            census = {"rogue"} if m.me in beats[round_] else set()
            if m.me not in missed[round_]:
                census |= set(honest)
            assert set(honest) <= set(m.decide(round_, census))
        for m in members.values():
            _send(members, m.me, m.list, round_)
        _send(members, "rogue", tuple(sorted(sends[round_])), claims[round_])


def test_a_sender_round_only_rises_and_stays_with_its_pair() -> None:
    """A replayed old header cannot lower a sender's round; a sender not booked is not
    booked by `heard` (it takes the verified path first); pairs stay apart."""
    book = SenderBook()
    book.add(KEY, EPOCH, "a", 5)
    book.heard(KEY, EPOCH, "a", 3)
    book.heard(KEY, EPOCH, "b", 9)
    book.heard(KEY, 1, "a", 9)
    assert book.rounds(KEY, EPOCH) == {"a": 5} and book.rounds(KEY, 1) == {}
    book.heard(KEY, EPOCH, "a", 7)
    assert book.rounds(KEY, EPOCH) == {"a": 7}


def test_audible_members_keeps_itself_the_census_and_the_recently_heard() -> None:
    """And every listed peer in an epoch's first QUIET_ROUNDS rounds (nothing can have
    been heard yet in it)."""
    listed = ["me", "beating", "heard", "stale", "silent"]
    heard = {"heard": 8, "stale": 7}
    kept = audible_members(listed, "me", {"beating"}, heard, 10, 0, quiet_rounds=2)
    assert kept == ("beating", "heard", "me")
    assert audible_members(listed, "me", set(), {}, 2, 0, quiet_rounds=2) == ("me",)
    assert audible_members(listed, "me", set(), {}, 11, 10, quiet_rounds=2) == tuple(sorted(listed))


def test_the_exchange_notes_a_booked_senders_later_rounds() -> None:
    """Wiring: GroupExchange._book books a live signed sender with its header's round, then
    notes its later rounds (the transport named the sender); a forged or dead author is not
    booked, so its rounds are never noted."""
    inside = _grouped("0")
    me, peer, dead = inside[:3]
    key = "groups.0b0"
    node = _exchange_node(me, {peer.peer_id})
    first = _header(peer, key)
    node._book(first)
    later = replace(first, round=first.round + 3)
    node._book(later)
    node._book(_header(dead, key))
    assert node.senders.rounds(key, first.epoch) == {peer.peer_id: first.round + 3}


def test_a_node_runs_its_round_without_a_listed_member_silent_past_quiet_rounds(
    tmp_path: Path,
) -> None:
    """Wiring (node.group_publishing): the round's list drops a decided member that is in
    no census and sent nothing, once QUIET_ROUNDS rounds of the epoch have passed, and
    keeps one in the census."""
    node = offline_node(tmp_path, group_size=1, codec="fp32")
    publishing = node.parts.publishing
    assert isinstance(publishing, GroupPublishing)
    me, rounds = publishing.me, publishing.groups.group_epoch_rounds
    assert rounds > QUIET_ROUNDS
    key = "groups.0b"
    grouping = Grouping(1, 0, {key: tuple(sorted([me, "dead", "beating"]))})
    first = rounds  # epoch 1's first round

    def members(round_: int) -> tuple[str, ...]:
        return publishing._members(grouping, key, 1, round_, [me, "beating"])

    assert members(first + QUIET_ROUNDS - 1) == grouping.members[key]
    assert members(first + QUIET_ROUNDS) == tuple(sorted([me, "beating"]))
