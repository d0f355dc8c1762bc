"""The fetch order (dht.fetch_order) through CatchUp's real fetch decisions, on a simulated
clock: a flooding fresh author cannot delay an established author's updates, nor start more
fetches than its cap, and none of its updates is dropped."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.catchup import CatchUp, CatchUpConfig
from dht.fetch_order import FetchOrder, FetchOrderConfig, TokenBucket

ORDER = FetchOrderConfig()
STEP_S = 0.1
"""How often the simulated pump asks CatchUp what to fetch (the real pump: on each kick)."""


class Applied:
    def __init__(self) -> None:
        self.ids: set[tuple[str, int]] = set()

    def has_applied(self, author: str, seq: int) -> bool:
        return (author, seq) in self.ids


def catchup_for(fresh: set[str], applied: Applied) -> CatchUp:
    catchup = CatchUp(CatchUpConfig(max_in_flight=4), "me", applied, FetchOrder(ORDER))
    catchup.is_fresh = lambda author: author in fresh
    return catchup


def simulate(
    announcements: list[tuple[float, str]], fresh: set[str], fetch_s: float, horizon_s: float
) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], float], Applied]:
    """Announcements (time, author) heard by one node whose fetches each take `fetch_s`:
    when each update was announced, and when its fetch started."""
    applied = Applied()
    catchup = catchup_for(fresh, applied)
    alive = {author for _, author in announcements}
    announced: dict[tuple[str, int], float] = {}
    started: dict[tuple[str, int], float] = {}
    running: list[tuple[float, tuple[str, int]]] = []
    seqs: dict[str, int] = {}
    pending = sorted(announcements)
    now = 0.0
    while now <= horizon_s:
        for done in [r for r in running if r[0] <= now]:
            running.remove(done)
            applied.ids.add(done[1])
            catchup.fetched(done[1])
        while pending and pending[0][0] <= now:
            _, author = pending.pop(0)
            seqs[author] = seqs.get(author, 0) + 1
            announced[(author, seqs[author])] = now
            catchup.announced(author, seqs[author], None, now)
        for fetch in catchup.next_fetches(now, alive):
            started[fetch.update_id] = now
            running.append((now + fetch_s, fetch.update_id))
        catchup.newly_deferred.clear()
        now += STEP_S
    return announced, started, applied


flood_rates = st.floats(min_value=1.0, max_value=12.0)
fetch_times = st.floats(min_value=0.1, max_value=1.0)


@settings(max_examples=25, deadline=None)
@given(
    flood_rate=flood_rates,
    fetch_s=fetch_times,
    round_s=st.floats(min_value=1.0, max_value=5.0),
    offset_s=st.floats(min_value=0.0, max_value=1.0),
    flooder=st.sampled_from(["a-flood", "zz-flood"]),
)
def test_a_flood_neither_delays_established_updates_nor_beats_its_cap(
    flood_rate: float, fetch_s: float, round_s: float, offset_s: float, flooder: str
) -> None:
    """For any interleaving of a fresh author's flood (whatever its key sorts as) and an
    established author's one update a round: every honest update's fetch starts at the first
    pump after it is announced, the flooder starts at most its burst plus its rate in any
    stretch of time, and every flood update is still fetched once the flood stops."""
    flood_s = honest_s = 5.0
    flood = [(i / flood_rate, flooder) for i in range(int(flood_s * flood_rate))]
    honest = [(offset_s + i * round_s, "honest") for i in range(int(2 * honest_s / round_s))]
    horizon_s = 2 * honest_s + len(flood) / ORDER.fresh_rate_per_s
    announced, started, applied = simulate(flood + honest, {flooder}, fetch_s, horizon_s)
    for uid, at in announced.items():
        if uid[0] == "honest":
            assert started[uid] - at <= STEP_S + 1e-9, uid
    flood_starts = sorted(t for (author, _), t in started.items() if author == flooder)
    for i, t0 in enumerate(flood_starts):
        for j in range(i, len(flood_starts)):
            window = flood_starts[j] - t0
            assert j - i + 1 <= ORDER.fresh_burst + ORDER.fresh_rate_per_s * window + 1e-9
    assert set(announced) <= applied.ids  # deferred, never dropped


@settings(max_examples=20, deadline=None)
@given(num_sybils=st.integers(min_value=2, max_value=40), fetch_s=fetch_times)
def test_many_fresh_keys_together_start_no_more_than_the_cohort_cap(
    num_sybils: int, fetch_s: float
) -> None:
    """Minting keys buys no more fetches: Sybils each announcing every 2 s start at most the
    cohort's burst plus its rate together, and hold at most max_fresh_in_flight slots."""
    sybils = {f"sybil{i:02d}" for i in range(num_sybils)}
    events = [(t * 2.0 + i * 0.01, s) for t in range(5) for i, s in enumerate(sorted(sybils))]
    announced, started, _ = simulate(events, sybils, fetch_s, 10.0)
    starts = sorted(started.values())
    for i, t0 in enumerate(starts):
        for j in range(i, len(starts)):
            assert j - i + 1 <= ORDER.cohort_burst + ORDER.cohort_rate_per_s * (starts[j] - t0)
    for t in starts:
        assert sum(1 for s in starts if t <= s < t + fetch_s - 1e-9) <= ORDER.max_fresh_in_flight


def test_established_authors_come_first_and_authors_take_turns() -> None:
    wanted = [("a-fresh", 1), ("a-fresh", 2), ("b", 2), ("b", 1), ("c", 5), ("z-fresh", 1)]
    order = FetchOrder().order(wanted, lambda author: author.endswith("fresh"))
    assert order == [("b", 1), ("c", 5), ("b", 2), ("a-fresh", 1), ("z-fresh", 1), ("a-fresh", 2)]


def test_a_deferred_update_is_noted_once_and_stays_wanted() -> None:
    applied = Applied()
    catchup = catchup_for({"f"}, applied)
    for seq in range(1, 11):
        catchup.announced("f", seq, None, 0.0)
    first = catchup.next_fetches(0.0, {"f"})
    assert [f.seq for f in first] == [1, 2]  # max_fresh_in_flight
    assert catchup.newly_deferred == [("f", seq) for seq in range(3, 11)]
    catchup.newly_deferred.clear()
    for fetch in first:
        applied.ids.add(fetch.update_id)
        catchup.fetched(fetch.update_id)
    assert [f.seq for f in catchup.next_fetches(0.0, {"f"})] == [3, 4]  # the burst of 4
    assert catchup.newly_deferred == [] and catchup.num_wanted == 8


def test_a_flood_of_fresh_wants_leaves_room_for_established_authors() -> None:
    """A flood announced faster than its cap lets it be fetched fills only its share of the
    wanted table; an established author's update is still wanted, and fetched first."""
    config = CatchUpConfig(max_in_flight=4, max_wants=64, max_fresh_wants=16)
    catchup = CatchUp(config, "me", Applied())
    catchup.is_fresh = lambda author: author == "flood"
    new = [catchup.announced("flood", seq, None, 0.0) for seq in range(1, 101)]
    assert sum(new) == 16 and len(catchup.newly_deferred) == 84
    assert catchup.announced("honest", 1, None, 0.0)
    assert catchup.next_fetches(0.0, {"flood", "honest"})[0].update_id == ("honest", 1)


def test_a_fresh_update_heard_again_at_the_cap_is_not_counted_again() -> None:
    """An update passed over at max_fresh_wants and heard again (a push, then an announcement
    lookup, then a summary) is one deferral, not one per hearing; the ids remembered as
    counted stay within max_deferred_remembered."""
    config = CatchUpConfig(max_fresh_wants=4, max_deferred_remembered=16)
    catchup = CatchUp(config, "me", Applied())
    catchup.is_fresh = lambda author: author == "flood"
    for _ in range(3):  # the same 20 ids heard three times
        for seq in range(1, 21):
            catchup.announced("flood", seq, None, 0.0)
    assert catchup.newly_deferred == [("flood", seq) for seq in range(5, 21)]
    catchup.newly_deferred.clear()  # the pump counts and clears them
    before = catchup.num_tracked()
    for seq in range(21, 1021):
        catchup.announced("flood", seq, None, 0.0)
    catchup.newly_deferred.clear()
    assert catchup.num_tracked() == before  # the oldest counted ids are forgotten


def test_no_fresh_author_means_the_old_order() -> None:
    catchup = CatchUp(CatchUpConfig(max_in_flight=4), "me", Applied())
    for author, seq in [("b", 2), ("a", 1), ("b", 1)]:
        catchup.announced(author, seq, None, 0.0)
    assert [f.update_id for f in catchup.next_fetches(0.0, {"a", "b"})] == [
        ("a", 1),
        ("b", 1),
        ("b", 2),
    ]
    assert catchup.newly_deferred == []


def test_a_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    bucket = TokenBucket(2.0, 3.0, now=0.0)
    for _ in range(3):
        bucket.take(0.0)
    assert bucket.tokens(0.0) == 0.0
    assert bucket.tokens(0.5) == 1.0
    assert bucket.tokens(-5.0) == 0.0  # a clock stepping back refills nothing
    assert bucket.tokens(100.0) == 3.0


@pytest.mark.parametrize(
    "field, value",
    [("fresh_rate_per_s", 0.0), ("cohort_burst", 0.5), ("max_fresh_in_flight", 0)],
)
def test_a_bad_config_is_one_clear_error(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        FetchOrderConfig(**{field: value})  # type: ignore[arg-type]
    for name in ("max_fresh_wants", "max_lost", "max_deferred_remembered"):
        with pytest.raises(ValueError, match=name):
            CatchUpConfig(**{name: 0})  # type: ignore[arg-type]
