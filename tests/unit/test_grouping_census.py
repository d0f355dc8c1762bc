"""One member list per group and epoch (dht/grouping_census.py): lists that differ because
censuses were partial or late heal within one exchange; lists that agree stay agreed; only
a signed, live peer inside the group's prefix is ever added, and only by itself."""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dht.group_exchange import GroupExchange
from dht.grouping import member_check, peer_bits
from dht.grouping_census import SenderBook, healed_members
from dht.grouping_view import EpochGrouping
from merge.group_update import ContributionHeader, RoundFields
from merge.identity import Identity

RUN = "run-census"


def _in_group(peer: str) -> bool:
    return peer.startswith("m")


def _exchange(lists: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
    """One round: each member sends its part to the members of its own list; each books its
    senders and heals its list."""
    books = {m: SenderBook() for m in lists}
    for sender, listed in lists.items():
        for receiver in listed:
            if receiver != sender and receiver in books:
                books[receiver].add("groups.0b1", 0, sender)
    return {
        m: healed_members(lists[m], books[m].senders("groups.0b1", 0), _in_group) for m in lists
    }


@st.composite
def _lists_apart(draw: st.DrawFn) -> dict[str, tuple[str, ...]]:
    """Member lists that differ as late or partial censuses make them: for every two
    members, at least one lists the other (a newcomer lists everyone; a node whose census
    missed a peer is listed by it)."""
    members = [f"m{i}" for i in range(draw(st.integers(2, 8)))]
    listed = {m: {m} for m in members}
    for a, b in itertools.combinations(members, 2):
        who = draw(st.sampled_from(["both", "a", "b"]))
        if who in ("both", "a"):
            listed[a].add(b)
        if who in ("both", "b"):
            listed[b].add(a)
    return {m: tuple(sorted(listed[m])) for m in members}


@given(_lists_apart())
def test_one_exchange_heals_lists_that_differ_by_late_or_partial_censuses(
    lists: dict[str, tuple[str, ...]],
) -> None:
    healed = _exchange(lists)
    assert set(healed.values()) == {tuple(sorted(lists))}
    assert _exchange(healed) == healed  # agreed lists stay agreed


@given(
    decided=st.sets(st.sampled_from([f"m{i}" for i in range(10)]), min_size=1),
    senders=st.sets(st.sampled_from([f"m{i}" for i in range(10)] + ["x0", "x1", "x2"])),
)
def test_a_list_only_grows_by_senders_inside_the_group(
    decided: set[str], senders: set[str]
) -> None:
    healed = healed_members(decided, senders, _in_group)
    assert list(healed) == sorted(healed)
    assert decided <= set(healed) <= decided | senders
    assert all(_in_group(p) for p in set(healed) - decided)  # an outsider is never added
    assert healed_members(healed, senders, _in_group) == healed


@given(rounds=st.lists(st.sets(st.sampled_from([f"m{i}" for i in range(6)])), max_size=6))
def test_a_list_never_shrinks_within_an_epoch(rounds: list[set[str]]) -> None:
    """Never waits for good: what a member once listed stays listed (a member that died is
    left out as any member missing the deadline), so a round needs only the members alive."""
    book = SenderBook()
    listed: tuple[str, ...] = ("m0",)

    for senders in rounds:
        for s in senders:
            book.add("groups.0b1", 0, s)
        healed = healed_members(listed, book.senders("groups.0b1", 0), _in_group)
        assert set(listed) <= set(healed)
        listed = healed


def test_a_book_is_bounded_and_keeps_pairs_apart() -> None:
    book = SenderBook(max_kept=2, max_senders=2)
    assert book.add("k", 0, "a") and book.add("k", 0, "b") and not book.add("k", 0, "c")
    assert book.add("k", 0, "a")  # booked already: still True, nothing grows
    assert book.senders("k", 0) == {"a", "b"} and book.senders("k", 1) == frozenset()
    book.add("k", 1, "a")
    book.add("j", 0, "a")  # a third pair drops the oldest
    assert book.senders("k", 0) == frozenset() and book.knows("j", 0, "a")
    with pytest.raises(ValueError):
        SenderBook(max_kept=0)


def test_a_replica_whose_census_was_partial_rejoins_the_split_within_the_epoch() -> None:
    """A replica that decided one group from four of six peers re-decides at its next round
    once the peers' heartbeats announce the split its census now bears (not at the next
    epoch, ten rounds on)."""
    from dht.grouping import GroupingConfig

    config = GroupingConfig(min_group_size=3)
    peers = [f"peer{i}" for i in range(6)]
    late = EpochGrouping(RUN, 10, config, me=peers[0])
    full = EpochGrouping(RUN, 10, config, me=peers[1])

    def bits(grouping: EpochGrouping, *args: object) -> int | None:
        decided = grouping.decide(*args)  # type: ignore[arg-type]
        return None if decided is None else decided.bits

    assert bits(late, 0, peers[:4]) == 0 and bits(full, 0, peers) == 1
    assert bits(late, 1, peers) == 0  # no announcement: the first decision stands
    announced = {peers[0]: 0, **{p: 1 for p in peers[1:]}}  # what the heartbeats say now
    assert late.decide(1, peers, announced) == full.decide(1, peers, announced)
    assert late.split.bits == 1  # the deepest split held that six peers bear
    assert bits(late, 2, peers[:2], {peers[1]: 1}) == 1  # a census that dips: no fall mid-epoch


# ---- the exchange books signed, live senders inside the group ---------------------------------

POOL = [Identity.generate() for _ in range(24)]  # >= 3 on each side but by ~1e-5 chance


def _grouped(prefix: str) -> list[Identity]:
    return [i for i in POOL if peer_bits(RUN, i.peer_id).startswith(prefix)]


def _exchange_node(me: Identity, alive: set[str]) -> GroupExchange:
    network = SimpleNamespace(identity=me, config=SimpleNamespace(run_id=RUN))
    return GroupExchange(
        network,  # type: ignore[arg-type]
        numel=4,
        reject=lambda *_: None,
        is_alive=alive.__contains__,
    )


def _header(identity: Identity, key: str) -> ContributionHeader:
    fields = RoundFields(
        run_id=RUN, group_key=key, epoch=2, round=20, learners=2, base_applied=0,
        published_applied=0,
    )  # fmt: skip
    return ContributionHeader.of(torch.ones(4), identity, fields, tokens=1)


def test_the_exchange_books_only_live_signed_senders_inside_the_group() -> None:
    inside, outside = _grouped("0"), _grouped("1")
    assert len(inside) >= 3 and outside
    me, peer, dead = inside[:3]
    key = "groups.0b0"
    node = _exchange_node(me, {peer.peer_id, outside[0].peer_id})
    node._book(_header(peer, key))
    node._book(_header(dead, key))  # not alive
    node._book(_header(me, key))  # itself
    node._book(_header(outside[0], key))  # outside the prefix its header names
    forged = _header(outside[0], key)
    node._book(replace(forged, author=peer.peer_id))  # signed with another key
    assert node.senders.senders(key, 2) == {peer.peer_id}
    assert member_check(RUN, key)(peer.peer_id)


def test_a_restarted_replica_follows_a_split_its_census_would_keep() -> None:
    """min group size 4: eight peers split in two, and hysteresis keeps the split down to six.
    A replica restarted into a census of seven (one heartbeat not read yet) decides one group
    alone; the split its peers announce is one its census would keep, so it follows it. Below
    the keep line it waits for its census (dht.grouping_split), then decides alone: a peer
    cannot split a swarm that small."""
    from dht.grouping import GroupingConfig

    config = GroupingConfig(min_group_size=4)
    peers = [f"peer{i}" for i in range(8)]

    def bits(census: list[str], announced: dict[str, object] | None, rounds: int = 1) -> object:
        grouping = EpochGrouping(RUN, 10, config, me=census[0])
        decided = [grouping.decide(0, census, announced) for _ in range(rounds)]
        return None if decided[-1] is None else decided[-1].bits

    assert bits(peers[:7], None) == 0
    assert bits(peers[:7], {p: 1 for p in peers[1:7]}) == 1
    assert bits(peers[:5], {p: 1 for p in peers[1:5]}) is None  # waits for its census
    assert bits(peers[:5], {p: 1 for p in peers[1:5]}, rounds=3) == 0  # then decides alone
    assert EpochGrouping(RUN, 10, config).rule.band(6) == (0, 1)
