"""Catch-up and repair decisions under scheduled (author, seq) faults, on a fake transport."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.catchup import CatchUp, CatchUpConfig
from dht.ranges import iter_ids, parse_ranges, to_ranges
from tests.unit.catchup_sim import CONFIG, Schedule, SimNode, SimSwarm

PEERS = ["a", "b", "c", "d"]
ALL = {(author, seq) for author in PEERS for seq in (1, 2, 3)}
SETTLE_S = 40.0


def publish_all(swarm: SimSwarm, seqs: range = range(1, 4)) -> None:
    for seq in seqs:
        for author in swarm.nodes:
            if swarm.nodes[author].alive:
                swarm.publish(author, seq)
        swarm.step()


def test_every_push_arriving_once_needs_no_repair() -> None:
    swarm = SimSwarm(PEERS)
    publish_all(swarm)
    swarm.run(SETTLE_S)
    assert all(applied == ALL for applied in swarm.applied_sets())
    assert swarm.num_fetches == len(ALL) * 3 and not swarm.lost_events


def test_a_dropped_push_is_repaired_from_a_summary() -> None:
    schedule = Schedule(deliveries={("b", ("a", 2)): []})
    swarm = SimSwarm(PEERS, schedule)
    publish_all(swarm)
    swarm.run(SETTLE_S)
    assert all(applied == ALL for applied in swarm.applied_sets())


def test_a_late_update_is_fetched_after_later_ones_of_its_author_were_applied() -> None:
    schedule = Schedule(deliveries={("b", ("a", 1)): [20.0]}, partition=({"a"}, 25.0, 1e9))
    swarm = SimSwarm(["a", "b"], schedule)
    swarm.nodes["a"].retained.add(("a", 1))
    swarm.nodes["a"].applied.add(("a", 1))  # published without telling b until t=20
    schedule.deliveries[("b", ("a", 1))] = [20.0]
    swarm.publish("a", 2)
    swarm.pushes.append((20.0, "b", ("a", 1)))
    swarm.run(1.0)
    assert swarm.nodes["b"].applied == {("a", 2)}
    swarm.run(21.0)
    assert swarm.nodes["b"].applied == {("a", 1), ("a", 2)}


def test_duplicates_are_applied_once_and_fetched_once() -> None:
    uid = ("a", 1)
    schedule = Schedule(deliveries={("b", uid): [0.5, 1.0, 1.5, 30.0]})
    swarm = SimSwarm(["a", "b"], schedule)
    swarm.publish(*uid)
    swarm.run(SETTLE_S)
    assert swarm.nodes["b"].applied == {uid}
    assert swarm.num_fetches == 1


def test_an_update_its_dead_author_gave_one_peer_reaches_the_others() -> None:
    schedule = Schedule(deaths={"a": 1.0})
    for receiver in ("c", "d"):
        schedule.deliveries[(receiver, ("a", 1))] = []
    swarm = SimSwarm(PEERS, schedule)
    swarm.publish("a", 1)
    swarm.run(SETTLE_S)
    assert [n.applied for n in swarm.live()] == [{("a", 1)}] * 3
    assert not swarm.lost_events


def test_an_update_no_live_peer_holds_is_declared_lost_once_and_not_fetched_forever() -> None:
    schedule = Schedule(deaths={"a": 1.0}, deliveries={("b", ("a", 2)): [0.5]})
    swarm = SimSwarm(["a", "b"], schedule)
    swarm.nodes["a"].retained = set()
    swarm.publish("a", 1)
    swarm.nodes["a"].retained.clear()  # evicted before anybody fetched it
    swarm.nodes["a"].applied.add(("a", 2))  # announced to b, held by nobody
    schedule.deliveries.clear()
    swarm.nodes["b"].catchup.announced("a", 2, None, 0.0)
    swarm.run(SETTLE_S)
    assert ("a", 2) in swarm.nodes["b"].catchup.lost
    assert swarm.lost_events.count(("b", ("a", 2))) == 1
    fetches = swarm.num_fetches
    swarm.run(2 * SETTLE_S)
    assert swarm.num_fetches == fetches, "a lost update is not fetched again without a holder"


def test_a_partition_that_heals_ends_in_equal_applied_sets() -> None:
    schedule = Schedule(partition=({"a", "b"}, 0.0, 20.0))
    swarm = SimSwarm(PEERS, schedule)
    publish_all(swarm)
    swarm.run(15.0)
    assert swarm.nodes["a"].applied != swarm.nodes["c"].applied
    swarm.run(20.0 + SETTLE_S)
    assert all(applied == ALL for applied in swarm.applied_sets())


def test_a_partition_longer_than_the_retention_loses_updates_and_says_so() -> None:
    """What no peer retains waits for a state while a live peer names it applied; once one
    side took the other's state (dht.realign's gap), what only it had applied is lost, and the
    other side says so when no live peer names it any more."""
    schedule = Schedule(partition=({"a"}, 0.0, 30.0), retain_limit=2)
    swarm = SimSwarm(["a", "b"], schedule)
    publish_all(swarm, range(1, 6))
    swarm.run(30.0 + SETTLE_S)
    a, b = swarm.nodes["a"], swarm.nodes["b"]
    missing_at_a = {("b", s) for s in range(1, 6)} - a.applied
    assert missing_at_a == {("b", 1), ("b", 2), ("b", 3)}
    assert set(a.catchup.state_wants) == missing_at_a, "not dropped: b's state brings them"
    assert set(b.catchup.state_wants) == {("a", 1), ("a", 2), ("a", 3)}
    assert not a.catchup.lost and not b.catchup.lost and not swarm.lost_events
    a.applied = set(b.applied)  # a takes b's state: a/1-3 are nowhere now
    swarm.run(swarm.now + SETTLE_S)
    assert not a.catchup.state_wants and a.catchup.state_wants.num_brought == 3
    assert b.catchup.lost == {("a", 1), ("a", 2), ("a", 3)}, "a real loss is still declared"
    assert sorted(swarm.lost_events) == [("b", ("a", s)) for s in (1, 2, 3)]


def test_a_holder_showing_up_later_recovers_a_lost_update() -> None:
    node = SimNode("b")
    catchup = node.catchup
    catchup.announced("a", 1, None, 0.0)
    catchup.failed(("a", 1), "a", 0.0, refused=True)  # "not held": evicted
    assert catchup.declare_lost(CONFIG.lost_after_s + 1, {"a"}) == [("a", 1)]
    catchup.holders("a", 1, ["c"], 15.0)  # a holder record may be stale: not trusted for it
    assert catchup.next_fetches(15.0, {"c"}) == []
    catchup.summary("c", {}, {"a": [(1, 1)]}, 20.0)  # a live peer says it holds it now
    assert [f.peer_id for f in catchup.next_fetches(20.0, {"c"})] == ["c"]
    assert catchup.lost == set() and catchup.num_recovered == 1


def test_a_holder_record_names_a_source_of_the_wanted_updates_in_its_ranges() -> None:
    """The author (its only source) is gone: the holder's record makes its wanted updates in
    the ranges fetchable from the holder; none outside them, none not wanted, none lost."""
    catchup = CatchUp(CONFIG, "b", SimNode("b"))
    for seq in (2, 3, 5, 9):
        catchup.announced("a", seq, None, 0.0)
    catchup.announced("x", 3, None, 0.0)
    catchup.held("a", "c", [(1, 3), (9, 2**53)], 1.0)
    fetches = catchup.next_fetches(1.0, {"c"})
    assert [(f.update_id, f.peer_id) for f in fetches] == [
        (("a", 2), "c"), (("a", 3), "c"), (("a", 9), "c"),
    ]  # fmt: skip
    assert catchup.num_wanted == 5, "a holder record wants nothing by itself"


def test_a_holder_record_naming_2_to_the_53_seqs_costs_the_wants_not_the_range() -> None:
    catchup = CatchUp(CONFIG, "b", SimNode("b"))
    catchup.announced("a", 10**12, None, 0.0)
    started = time.perf_counter()
    catchup.held("a", "c", [(s, s + 2**40) for s in range(1, 16 * 2**41, 2**41)], 1.0)
    assert time.perf_counter() - started < 0.05
    assert [f.peer_id for f in catchup.next_fetches(1.0, {"c"})] == ["c"]


def test_lost_updates_are_remembered_up_to_max_lost_the_oldest_forgotten_first() -> None:
    """A flood of ids no live peer holds cannot grow the lost table without bound."""
    config = CatchUpConfig(lost_after_s=1.0, max_lost=3)
    catchup = CatchUp(config, "b", SimNode("b"))
    for seq in range(1, 6):
        catchup.announced("a", seq, None, 0.0)
    catchup.declare_lost(0.0, set())
    assert catchup.declare_lost(2.0, set()) == [("a", s) for s in range(1, 6)]
    assert catchup.lost == {("a", 3), ("a", 4), ("a", 5)}
    assert catchup.num_tracked() == 3 + 1  # lost + max_seen
    assert not catchup.knows(("a", 1)) and catchup.knows(("a", 5))


def test_fetches_are_bounded_and_lowest_seqs_go_first() -> None:
    catchup = CatchUp(CatchUpConfig(max_in_flight=2), "b", SimNode("b"))
    for seq in (5, 3, 4, 1):
        catchup.announced("a", seq, None, 0.0)
    assert [f.seq for f in catchup.next_fetches(0.0, {"a"})] == [1, 3]
    assert catchup.next_fetches(0.0, {"a"}) == []


def test_summaries_wait_out_the_grace_and_then_the_period() -> None:
    catchup = SimNode("b").catchup
    assert catchup.summary_peers(0.0, "x", {"a": "y"}) == []
    assert catchup.summary_peers(CONFIG.mismatch_grace_s, "x", {"a": "y"}) == ["a"]
    assert catchup.summary_peers(CONFIG.mismatch_grace_s + 0.1, "x", {"a": "y"}) == []
    assert catchup.summary_peers(10.0, "y", {"a": "y"}) == []


def test_ranges_round_trip_and_untrusted_ranges_are_refused() -> None:
    ranges = to_ranges({"a": [3, 1, 2, 7], "b": []})
    assert ranges == {"a": [(1, 3), (7, 7)]}
    assert parse_ranges({"a": [[1, 3], [7, 7]]}, max_ids=10) == ranges
    assert sorted(iter_ids(ranges)) == [("a", 1), ("a", 2), ("a", 3), ("a", 7)]
    for bad in ({"a": [[3, 1]]}, {"a": [[1, True]]}, {"a": "x"}, [1], {"a": [[0, 10**9]]}):
        with pytest.raises(ValueError):
            parse_ranges(bad, max_ids=1000)


updates = st.sets(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 6)), min_size=1)
arrivals = st.lists(st.floats(0.5, 30.0), max_size=3)  # [] drops, two or more duplicate


@settings(max_examples=30, deadline=None)
@given(data=st.data(), published=updates)
def test_any_arrival_order_drops_and_duplicates_end_in_equal_applied_sets(
    data: st.DataObject, published: set[tuple[str, int]]
) -> None:
    peers = ["a", "b", "c"]
    schedule = Schedule()
    for uid in published:
        for receiver in peers:
            if receiver != uid[0]:
                schedule.deliveries[(receiver, uid)] = data.draw(arrivals)
    swarm = SimSwarm(peers, schedule)
    for uid in sorted(published, key=lambda u: data.draw(st.floats(0, 1))):
        swarm.publish(*uid)
    swarm.run(45.0)
    assert all(applied == published for applied in swarm.applied_sets())
    assert not swarm.lost_events


def test_a_summary_naming_a_million_updates_is_bounded() -> None:
    """A live peer's summary may name 10**6 ids (the parser's cap): at most max_wants are kept."""
    catchup = CatchUp(CatchUpConfig(max_wants=1000), "b", SimNode("b"))
    ranges = {f"sybil-{i}": [(1, 10_000)] for i in range(100)}
    catchup.summary("mallory", ranges, ranges, now=0.0)
    assert catchup.num_wanted == 1000
    catchup.announced("a", 1, None, now=0.0)  # full: an honest one waits for room too
    assert catchup.num_wanted == 1000


def test_a_peer_that_leaves_takes_its_bookkeeping_with_it() -> None:
    catchup = CatchUp(CatchUpConfig(), "b", SimNode("b"))
    before = catchup.num_tracked()
    for seq in range(1, 50):
        catchup.announced("sybil", seq, None, now=0.0)
        catchup.fetched(("sybil", seq))  # refused for good: settled
    catchup.summary_peers(0.0, "mine", {"sybil": "theirs"})
    catchup.holder_lookups(0.0, alive=set())
    assert catchup.num_tracked() > before
    catchup.forget_peer("sybil")
    assert catchup.num_tracked() == before


def test_a_crowd_of_mismatched_peers_costs_few_summaries_and_starves_no_contributor() -> None:
    catchup = CatchUp(CatchUpConfig(mismatch_grace_s=0, summary_period_s=5), "b", SimNode("b"))
    digests = {f"sybil-{i:04d}": "junk" for i in range(1000)} | {"zz-honest": "theirs"}
    first = catchup.summary_peers(0.0, "mine", digests, preferred={"zz-honest"})
    assert len(first) == CatchUpConfig().max_summaries and first[0] == "zz-honest"
    second = catchup.summary_peers(1.0, "mine", digests, preferred={"zz-honest"})
    assert len(second) == len(first) and not set(first) & set(second)  # least recently asked
    assert catchup.summary_peers(5.0, "mine", digests, preferred={"zz-honest"})[0] == "zz-honest"


def test_an_author_whose_fetches_fail_stays_a_source_asked_again_with_backoff() -> None:
    """A live author is its update's only holder (tests/swarm/test_nat.py: two homes, a relay
    that flaps): failed fetches from it are retried 1, 2, 4, 8 s later (retry_s doubled, up to
    max_retry_s), never declared lost meanwhile; after author_retries failures in a row it is
    asked no more and the update is lost lost_after_s later."""
    config = CatchUpConfig(lost_after_s=10.0, retry_s=1.0, author_retries=5, max_retry_s=8.0)
    catchup = CatchUp(config, "b", SimNode("b"))
    catchup.announced("a", 1, None, 0.0)
    now, asked_at = 0.0, list[float]()
    while now < 100.0:
        assert not catchup.declare_lost(now, {"a"}) or len(asked_at) == 5, now
        for fetch in catchup.next_fetches(now, {"a"}):
            asked_at.append(now)
            catchup.failed(fetch.update_id, fetch.peer_id, now)
        now += 0.25
    assert asked_at == [0.0, 1.0, 3.0, 7.0, 15.0]
    assert catchup.lost == {("a", 1)}


def test_a_refusal_drops_the_author_at_once_and_a_success_needs_no_retry() -> None:
    catchup = CatchUp(CONFIG, "b", SimNode("b"))
    catchup.announced("a", 1, None, 0.0)
    catchup.announced("a", 2, None, 0.0)
    assert len(catchup.next_fetches(0.0, {"a"})) == 2
    catchup.failed(("a", 1), "a", 0.0, refused=True)  # "not held"
    catchup.failed(("a", 2), "a", 0.0)  # a cut stream
    assert [f.update_id for f in catchup.next_fetches(CONFIG.retry_s, {"a"})] == [("a", 2)]
    catchup.fetched(("a", 2))
    assert catchup.declare_lost(0.5, {"a"}) == []
    assert catchup.declare_lost(0.5 + CONFIG.lost_after_s, {"a"}) == [("a", 1)]


@settings(max_examples=50, deadline=None)
@given(
    outcomes=st.lists(st.sampled_from(["cut", "cut", "refused", "ok"]), min_size=1, max_size=12),
    retries=st.integers(1, 6),
    tick=st.sampled_from([0.1, 0.5, 1.5]),
)
def test_an_author_is_asked_again_only_after_its_backoff_and_at_most_retries_times(
    outcomes: list[str], retries: int, tick: float
) -> None:
    """Whatever its fetches bring: the author is never asked again sooner than retry_s after a
    failure, nor after `retries` failures in a row or a refusal; a live author's update is
    never lost while it may still be asked."""
    config = CatchUpConfig(lost_after_s=5.0, retry_s=1.0, author_retries=retries, max_retry_s=4.0)
    catchup = CatchUp(config, "b", SimNode("b"))
    catchup.announced("a", 1, None, 0.0)
    now, failures, last_failed, given_up = 0.0, 0, None, False
    for outcome in outcomes:
        fetches: list[object] = []
        while not fetches and now < 200.0:
            lost = catchup.declare_lost(now, {"a"})
            assert not lost or given_up, (now, failures)
            if lost:
                return
            fetches = list(catchup.next_fetches(now, {"a"}))
            if not fetches:
                now += tick
        assert fetches, "an author that may still be asked is asked again"
        assert not given_up
        if last_failed is not None:
            assert now - last_failed >= config.retry_s
        if outcome == "ok":
            catchup.fetched(("a", 1))
            assert catchup.next_fetches(now + 100.0, {"a"}) == []
            return
        catchup.failed(("a", 1), "a", now, refused=outcome == "refused")
        failures, last_failed = failures + 1, now
        given_up = outcome == "refused" or failures >= retries


@pytest.mark.parametrize(("field", "value"), [("author_retries", 0), ("max_retry_s", -1.0)])
def test_a_bad_retry_config_is_one_clear_error(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        CatchUpConfig(**{field: value})  # type: ignore[arg-type]


def test_a_holder_on_a_direct_connection_is_asked_before_an_author_behind_a_relay() -> None:
    """Behind NAT (bench.chaos --topology nat) a home's update took 12-15 s through the relay
    and 0.5-0.9 s from the public node that had merged it."""
    ranks = {"a": 1, "c": 0, "d": 2}  # a: relayed, c: direct, d: not connected
    catchup = CatchUp(CONFIG, "b", SimNode("b"))
    catchup.source_rank = ranks.__getitem__
    catchup.announced("a", 1, None, 0.0)
    catchup.announced("a", 2, None, 0.0)
    catchup.announced("a", 1, None, 0.0, holder="c")
    catchup.announced("a", 2, None, 0.0, holder="d")
    fetches = catchup.next_fetches(0.0, {"a", "c", "d"})
    assert [(f.seq, f.peer_id) for f in fetches] == [(1, "c")]  # #2 waits for c to hold it
    catchup.failed(("a", 1), "c", 0.0)  # the direct holder failed: the author, on the relay
    assert [(f.seq, f.peer_id) for f in catchup.next_fetches(0.1, {"a", "c", "d"})] == [(1, "a")]
    patience = CONFIG.relay_patience_s  # c never offered #2: the author, on the relay
    assert [(f.seq, f.peer_id) for f in catchup.next_fetches(patience, {"a", "c", "d"})] == [
        (2, "a")
    ]


def test_an_update_only_a_relay_reaches_waits_for_the_direct_peer_to_hold_it() -> None:
    """Behind NAT (bench.chaos --topology nat, session 15) a home fetched a home's update
    through the relay while the public node was fetching it too: the author's thin uplink
    carried it twice. It waits relay_patience_s for the public node to offer it."""
    ranks = {"a": 1, "c": 0}  # a: a home behind the relay, c: the public node, direct
    catchup = CatchUp(CONFIG, "b", SimNode("b"))
    catchup.source_rank = ranks.__getitem__
    catchup.announced("a", 1, None, 0.0)
    assert catchup.next_fetches(0.0, {"a", "c"}) == []
    catchup.announced("a", 1, None, 2.0, holder="c")  # c merged it and says so
    assert [f.peer_id for f in catchup.next_fetches(2.0, {"a", "c"})] == ["c"]


def test_an_update_only_a_relay_reaches_is_fetched_at_once_without_a_direct_peer() -> None:
    """The public node down (the partition of bench.chaos's NAT run): nobody to wait for."""
    catchup = CatchUp(CONFIG, "b", SimNode("b"))
    catchup.source_rank = {"a": 1, "d": 1}.__getitem__
    catchup.announced("a", 1, None, 0.0)
    assert [f.peer_id for f in catchup.next_fetches(0.0, {"a", "d"})] == ["a"]
    off = CatchUp(replace(CONFIG, relay_patience_s=0.0), "b", SimNode("b"))
    off.source_rank = {"a": 1, "c": 0}.__getitem__
    off.announced("a", 1, None, 0.0)
    assert [f.peer_id for f in off.next_fetches(0.0, {"a", "c"})] == ["a"]


def test_among_sources_on_equal_connections_the_author_comes_first() -> None:
    catchup = CatchUp(CONFIG, "b", SimNode("b"))  # every source ranked alike (loopback)
    catchup.announced("a", 1, None, 0.0, holder="c")
    catchup.announced("a", 1, None, 0.0)
    assert [f.peer_id for f in catchup.next_fetches(0.0, {"a", "c"})] == ["a"]


@settings(max_examples=100, deadline=None)
@given(
    ranks=st.dictionaries(st.sampled_from(PEERS), st.integers(0, 2), min_size=4, max_size=4),
    holders=st.sets(st.sampled_from(["c", "d"])),
)
def test_the_source_asked_is_on_the_best_connection_and_the_author_when_it_is(
    ranks: dict[str, int], holders: set[str]
) -> None:
    catchup = CatchUp(replace(CONFIG, relay_patience_s=0.0), "b", SimNode("b"))
    catchup.source_rank = ranks.__getitem__
    catchup.announced("a", 1, None, 0.0)
    for holder in holders:
        catchup.announced("a", 1, None, 0.0, holder=holder)
    (fetch,) = catchup.next_fetches(0.0, set(PEERS))
    best = min(ranks[s] for s in holders | {"a"})
    assert ranks[fetch.peer_id] == best
    assert (fetch.peer_id == "a") == (ranks["a"] == best)


@settings(max_examples=200, deadline=None)
@given(
    ranks=st.dictionaries(st.sampled_from(PEERS), st.integers(0, 2), min_size=4, max_size=4),
    holders=st.sets(st.sampled_from(["c", "d"])),
    alive=st.sets(st.sampled_from(["c", "d"])),
    wait_s=st.floats(0.0, 20.0),
)
def test_a_relayed_source_waits_only_while_a_direct_peer_may_offer_it_and_not_longer(
    ranks: dict[str, int], holders: set[str], alive: set[str], wait_s: float
) -> None:
    catchup = CatchUp(CONFIG, "b", SimNode("b"))
    catchup.source_rank = ranks.__getitem__
    catchup.announced("a", 1, None, 0.0)
    for holder in holders:
        catchup.announced("a", 1, None, 0.0, holder=holder)
    live = alive | {"a", "b"}
    fetches = catchup.next_fetches(wait_s, live)
    best = min(ranks[s] for s in (holders & live) | {"a"})
    may_offer = any(ranks[p] == 0 for p in alive - holders)
    waits = best == 1 and may_offer and wait_s < CONFIG.relay_patience_s
    assert (fetches == []) == waits
    assert all(ranks[f.peer_id] == best for f in fetches)
