"""One split on every replica (dht/grouping_split.py, session 14): whatever order and pace peers
join in, and whatever each replica's census held when it first decided, every live replica
ends on one split within a bounded number of epochs once the censuses agree, and stays there;
a newcomer waits a bounded number of rounds rather than form a group from a partial census;
no announcement moves a replica past what its own census bears."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import GroupingConfig, GroupingPolicy
from dht.grouping_split import SplitRule, SplitState
from dht.grouping_view import EpochGrouping

RUN = "run-split"
PEERS = [f"12D3KooWsplit{i:04d}" for i in range(64)]


def rule(min_group_size: int = 4, patience: int = 2, max_bits: int = 5) -> SplitRule:
    config = GroupingConfig(min_group_size=min_group_size, max_bits=max_bits)
    return SplitRule(GroupingPolicy(RUN, config), patience)


def test_a_census_bears_the_splits_hysteresis_keeps() -> None:
    """--group-size 4 (hysteresis 0.25): a split needs 10 peers and is kept down to 6; two
    need 20 and are kept down to 12. So 16 peers bear one or two bits, 9 bear none or one."""
    r = rule()
    assert r.band(4) == (0, 0) and r.band(9) == (0, 1) and r.band(10) == (1, 1)
    assert r.band(16) == (1, 2) and r.band(20) == (2, 2) and r.band(1000) == (5, 5)


def test_the_deepest_split_held_in_band_counts_and_junk_is_ignored() -> None:
    r = rule()
    peers = PEERS[:6]
    announced: dict[str, object] = {p: 1 for p in peers}
    assert r.heard("me", 16, announced) == (1, True)
    assert r.heard("me", 16, {**announced, peers[0]: 2}) == (2, True)
    assert r.heard("me", 16, {**announced, peers[0]: 3}) == (1, True)  # 16 do not bear 3
    assert r.heard("me", 5, announced) == (None, True)  # 5 bear no split: heard, not taken
    for junk in (True, -1, 6, "2", None, 2.0):
        assert r.heard("me", 16, {**announced, peers[0]: junk}) == (1, True)
        assert r.heard("me", 16, {peers[0]: junk}) == (None, False)
    assert r.heard(peers[0], 16, {peers[0]: 2}) == (None, False)  # its own, read back


def test_patience_must_be_a_nonnegative_integer() -> None:
    with pytest.raises(ValueError, match="patience"):
        rule(patience=-1)


@given(
    n=st.integers(1, 200),
    own=st.none() | st.integers(0, 5),
    followed_down=st.booleans(),
    waited=st.integers(0, 4),
    announced=st.lists(st.integers(0, 5), max_size=6),
    new_epoch=st.booleans(),
)
def test_no_announcement_moves_a_replica_past_what_its_census_bears(
    n: int,
    own: int | None,
    followed_down: bool,
    waited: int,
    announced: list[int],
    new_epoch: bool,
) -> None:
    """Whatever live peers announce (strangers included), a replica that moves moves into
    its own census's band, and never leaves a split in band for a shallower one."""
    r = rule()
    lo, hi = r.band(n)
    peers_bits, heard = r.heard("me", n, dict(zip(PEERS, announced, strict=False)))
    state = SplitState(own, followed_down and own is not None, waited if own is None else 0)
    after = r.next(state, n, peers_bits, heard, new_epoch)
    if after.bits is None:
        assert own is None and heard and peers_bits is None
        assert after.waited == waited + 1 <= r.patience
    elif after.bits != own:
        assert lo <= after.bits <= hi
    if own is not None and lo <= own <= hi:
        assert after.bits is not None and after.bits >= own


@given(
    n=st.integers(1, 100),
    announced=st.lists(st.integers(0, 5), min_size=1, max_size=40),
    epoch_rounds=st.integers(1, 12),
)
def test_a_toggling_peer_moves_a_follower_down_at_most_twice_an_epoch(
    n: int, announced: list[int], epoch_rounds: int
) -> None:
    """A hostile peer that flips its announced split each round: the follower goes down at
    most once mid-epoch and once at its start (bounded churn), never out of band."""
    r = rule(patience=0)
    state = r.next(SplitState(), n, None, False, True)
    downs: dict[int, int] = {}
    for i, bits in enumerate(announced, start=1):
        before = state.bits
        peers_bits, heard = r.heard("me", n, {"stranger": bits})
        state = r.next(state, n, peers_bits, heard, i % epoch_rounds == 0)
        assert state.bits is not None and before is not None
        if state.bits < before:
            downs[i // epoch_rounds] = downs.get(i // epoch_rounds, 0) + 1
    assert all(count <= 2 for count in downs.values())


def test_a_newcomer_waits_for_its_census_then_decides_alone() -> None:
    """A restarted node reads 5 of 16 heartbeats: 5 peers bear no split, its peers hold one.
    It waits (no grouping) for `patience` rounds; its census filled: it follows; never
    filled: its own census decides."""
    r = rule(patience=2)
    state = SplitState()
    for waited in (1, 2):
        state = r.next(state, 5, None, True, True)
        assert (state.bits, state.waited) == (None, waited)
    assert r.next(state, 16, 1, True, True).bits == 2  # the census filled: 16 bear 2
    assert r.next(state, 5, None, True, True).bits == 0  # patience spent: alone


def test_a_split_kept_by_hysteresis_does_not_drop_for_a_census_that_dips_mid_epoch() -> None:
    r = rule()
    state = SplitState(1)
    for _ in range(5):  # 16 peers, one split; the census dips to 5 for a few reads
        state = r.next(state, 5, None, True, False)
        assert state.bits == 1
    assert r.next(state, 16, 1, True, True).bits == 1


def test_a_live_view_that_flaps_under_load_does_not_move_the_split() -> None:
    """Session 14's N = 16 run at load ~40: node8's census read 7, 1, 8, 11, 7, 3, 9, 8, 6,
    8, 4, 6 live peers round by round while some peers held no split and some one bit; it
    went 0b -> 0b1 -> 0b -> 0b1. A census is proven for `memory` rounds: once a census bore
    the split, a dip below the keep line (6 peers) neither drops it nor follows a peer down."""
    config = GroupingConfig(min_group_size=4)
    grouping = EpochGrouping(RUN, 10, config, me=PEERS[0])
    announced = {PEERS[1]: 0, PEERS[2]: 1}
    held = []
    for round_, size in enumerate((7, 1, 8, 11, 7, 3, 9, 8, 6, 8, 4, 6)):
        decided = grouping.decide(round_, PEERS[:size] if size else PEERS[:1], announced)
        held.append(None if decided is None else decided.bits)
    assert held[held.index(1) :] == [1] * (len(held) - held.index(1)), held
    short = SplitRule(GroupingPolicy(RUN, config), memory=1)  # no memory: it flaps
    state = short.next(SplitState(), 11, 1, True, True)
    assert state.bits == 1 and short.next(state, 4, 0, True, False).bits == 0


def test_memory_must_be_a_positive_integer() -> None:
    with pytest.raises(ValueError, match="memory"):
        SplitRule(GroupingPolicy(RUN), memory=0)


def test_session_13s_three_splits_become_one() -> None:
    """bench.scale --sizes 16 --group-size 4 (session 13): nodes held groups.0b (first census
    of 5), groups.0b0/0b1 (9-15) and, had one read all 16, two bits. With every census full
    they end on one split: two bits, the deepest held that 16 bear (within one round)."""
    config = GroupingConfig(min_group_size=4)
    peers = PEERS[:16]
    nodes = {p: EpochGrouping(RUN, 10, config, me=p) for p in peers}
    for i, p in enumerate(peers):  # first decisions from partial censuses of 5, 12 or 16
        census = peers[: (5, 12, 16)[i % 3]]
        nodes[p].decide(0, [p, *census])
    assert len({g.split.bits for g in nodes.values()}) == 3
    for round_ in (1, 2):
        announced = {p: g.split.bits for p, g in nodes.items()}
        for g in nodes.values():
            g.decide(round_, peers, announced)
    assert {g.split.bits for g in nodes.values()} == {2}


@dataclass
class Replica:
    grouping: EpochGrouping
    joined: int
    lag: dict[str, int]
    """Steps after a peer's (re)start until this replica's census holds it."""
    pace: float
    round: int = 0
    history: list[int | None] = field(default_factory=list)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 24),
    min_group_size=st.integers(2, 4),
    epoch_rounds=st.integers(1, 4),
    patience=st.integers(0, 3),
    seed=st.integers(0, 2**32),
)
def test_any_interleaving_of_joins_and_censuses_ends_on_one_split_within_two_epochs(
    n: int, min_group_size: int, epoch_rounds: int, patience: int, seed: int
) -> None:
    """Peers join (and some restart) at random steps; each replica's census holds a peer some
    random steps after it (re)started, and reads its announced split up to 2 steps stale;
    replicas decide at their own pace (a round per step with some chance). Once joins stop
    and every census holds everyone, every replica is on one split within
    2 epochs + patience + a few rounds of its own, and none moves after."""
    rng = random.Random(seed)
    config = GroupingConfig(min_group_size=min_group_size, max_bits=3)
    joins, max_lag = 12, 6
    ids = PEERS[:n]
    started = {p: rng.randrange(joins) for p in ids}
    restart = {p: rng.randrange(joins) for p in ids if rng.random() < 0.2}

    def fresh(p: str, at: int) -> Replica:
        lag = {q: rng.randrange(max_lag + 1) for q in ids}
        grouping = EpochGrouping(RUN, epoch_rounds, config, me=p, patience=patience)
        return Replica(grouping, at, lag, rng.uniform(0.3, 1.0))

    replicas: dict[str, Replica] = {}
    quiet = joins + max_lag + 3  # every census full, every announcement current
    bound = 2 * epoch_rounds + patience + 4  # rounds of a replica's own after `quiet`

    def step(at: int) -> None:
        for p in ids:
            if started[p] == at or restart.get(p) == at:
                replicas[p] = fresh(p, at)
        snapshot = {
            p: r.history[-1 - rng.randrange(min(3, len(r.history)))]
            for p, r in replicas.items()
            if r.history
        }
        for p, r in replicas.items():
            census = [q for q in replicas if replicas[q].joined + r.lag[q] <= at or q == p]
            if at < quiet and rng.random() > r.pace:
                r.history.append(r.grouping.split.bits)
                continue
            announced = {q: snapshot.get(q) for q in census if q != p}
            if r.grouping.decide(r.round, census, announced) is not None:
                r.round += 1
            r.history.append(r.grouping.split.bits)

    for at in range(quiet + bound):  # after `quiet`, every replica decides every step
        step(at)
    settled = {r.history[-1] for r in replicas.values()}
    assert len(settled) == 1 and None not in settled, settled
    lo, hi = SplitRule(GroupingPolicy(RUN, config)).band(n)
    bits = next(iter(settled))
    assert bits is not None and lo <= bits <= hi
    for at in range(quiet + bound, quiet + 2 * bound):  # and it stays there
        step(at)
    assert {bits for r in replicas.values() for bits in r.history[-bound:]} == settled
