"""The virtual-clock schedule of bench.correction_sim: who applies what, when, and how stale."""

import pytest

from bench.correction_sim import Apply, Arm, Publication, schedule, staleness_views


def _split(events: list[Publication | Apply]) -> tuple[list[Publication], list[Apply]]:
    pubs = [e for e in events if isinstance(e, Publication)]
    return pubs, [e for e in events if isinstance(e, Apply)]


@pytest.mark.parametrize("lag", [0.0, 5.0, 25.0])
def test_every_replica_applies_every_publication_once_its_author_first(lag: float) -> None:
    events = schedule([1, 2, 4], 10, 120, lag)
    pubs, applies = _split(events)
    assert len(pubs) == 12 + 6 + 3
    for replica in range(3):
        held = [a.publication for a in applies if a.replica == replica]
        assert sorted(held) == list(range(len(pubs)))
    for k, event in enumerate(events):
        if isinstance(event, Publication):
            follow = events[k + 1]
            assert isinstance(follow, Apply)
            assert (follow.replica, follow.publication) == (event.author, event.index)
    assert schedule([1, 2, 4], 10, 120, lag) == events  # pure


def test_without_lag_equal_learners_miss_only_their_own_round() -> None:
    pubs, applies = _split(schedule([1, 1, 1], 10, 100, 0.0))
    assert {(p.staleness, p.late) for p in pubs[3:]} == {(2, 0)}
    assert {a.missing for a in applies[9:]} == {2}
    assert staleness_views(schedule([1, 1, 1], 10, 100, 0.0), 3)["apply"] == 0.0


def test_a_lag_makes_bases_miss_the_round_before_and_only_late_sees_it() -> None:
    """Half a round of lag: every update is still signed 2 stale of M = 3 (fresh), yet its
    base lacked the peers' updates of the round before; the replicas hold 2 to 4 updates
    its base lacked when they apply it (0 to 2 without the lag), and the author's late count
    finds the 2."""
    events = schedule([1, 1, 1], 10, 100, 5.0)
    pubs, applies = _split(events)
    assert {(p.staleness, p.late) for p in pubs[6:]} == {(2, 2)}  # after two rounds
    assert {a.missing for a in applies[18:]} == {2, 3, 4}
    views = staleness_views(events, 3)
    assert views["signed"] == 0.0
    assert views["apply"] > 0.0  # 3 and 4 are beyond the M - 1 of its own round
    assert 0.5 < views["late"] < 2 / 3  # 2 / 3 once the first two rounds are past


def test_the_slowest_learner_is_the_stalest() -> None:
    pubs, _ = _split(schedule([1, 2, 4], 10, 200, 0.0))
    by_author = {a: max(p.staleness for p in pubs if p.author == a) for a in range(3)}
    assert by_author[2] > by_author[1] > by_author[0]


def test_arms_parse_kind_strength_and_view() -> None:
    assert str(Arm.parse("none")) == "none:1@signed"
    assert str(Arm.parse("heloco")) == "heloco:10@signed"
    assert str(Arm.parse("heloco:3@late")) == "heloco:3@late"
    assert Arm.parse("heloco:3").correction.strength == 3
    assert Arm.parse("lookahead@apply").correction.kind == "lookahead"
    for bad in ("bogus", "none@when", "heloco:x"):
        with pytest.raises(ValueError, match="arm|KIND"):
            Arm.parse(bad)
