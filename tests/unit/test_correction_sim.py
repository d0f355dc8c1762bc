"""The virtual-clock schedule of bench.correction_sim: who applies what, when, and how stale."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.correction_sim import (
    REUNION_RULES,
    Apply,
    Arm,
    Publication,
    Reunion,
    drift,
    schedule,
    staleness_views,
)


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


def test_a_partition_holds_back_what_its_learners_publish_and_marks_them_alone() -> None:
    events = schedule([1, 1, 1, 1], 10, 160, 0.0, (60.0, 120.0))
    pubs, applies = _split(events)
    assert {p.time for p in pubs if p.alone} == {60.0, 70.0, 80.0, 90.0, 100.0, 110.0}
    assert {p.staleness for p in pubs if p.alone and p.time > 60} == {0}  # it applied no one's
    held_back = [a for a in applies if a.held_back]
    assert len(held_back) == 6 * 4 * 3 and {a.time for a in held_back} == {120.0}
    assert all(pubs[a.publication].alone and a.replica != pubs[a.publication].author
               for a in held_back)  # fmt: skip


@given(
    speeds=st.lists(st.sampled_from([1.0, 2.0, 4.0]), min_size=1, max_size=4),
    lag=st.sampled_from([0.0, 3.0, 10.0]),
    rules=st.lists(st.sampled_from(REUNION_RULES), max_size=3),
)
@settings(max_examples=30, deadline=None)
def test_without_a_partition_the_reunion_rules_change_nothing_but_the_staleness_ones(
    speeds: list[float], lag: float, rules: list[str]
) -> None:
    events = schedule(speeds, 10, 60, lag)
    pubs, applies = _split(events)
    reunion = Reunion(tuple(r for r in rules if r not in ("seen", "zeroplain")), len(speeds), None)
    for apply in applies:
        pub = pubs[apply.publication]
        assert not (pub.alone or apply.held_back)
        assert reunion.factor(pub, apply) == 1.0 and not reunion.plain(pub, apply)
        assert not reunion.first_backlog(apply)


def test_the_signed_rules_weigh_an_update_alike_on_every_replica() -> None:
    """claim and claimplain read the publication only: one weight and one kind of step for
    an update whichever replica applies it (the oracles' scale and plain do not: the author
    took its own update as it came)."""
    events = schedule([1, 1, 1, 1], 10, 160, 0.0, (60.0, 120.0))
    pubs, applies = _split(events)
    rule_sets = [
        ("claim",), ("claimplain",), ("claim1", "claim1plain"), ("claim", "claimplain"),
        ("zeroplain",), ("seen",),
    ]  # fmt: skip
    for rules in rule_sets:
        reunion = Reunion(rules, 4, (60.0, 120.0))
        seen: dict[int, set[tuple[float, bool]]] = {}
        for a in applies:
            pub = pubs[a.publication]
            seen.setdefault(pub.index, set()).add((reunion.factor(pub, a), reunion.plain(pub, a)))
        assert all(len(kinds) == 1 for kinds in seen.values())
        assert {reunion.factor(p, applies[0]) for p in pubs if p.alone} <= {0.25, 0.5, 0.75, 1.0}


def test_an_author_alone_signs_the_others_of_its_last_applied_then_itself() -> None:
    pubs, _ = _split(schedule([1, 1, 1, 1], 10, 160, 0.0, (40.0, 120.0)))
    assert {p.claim for p in pubs if not p.alone} == {4}  # the swarm whole
    assert [p.claim for p in pubs if p.author == 0 and p.alone] == [4] * 6 + [3, 2]
    pubs, _ = _split(schedule([1, 1, 1, 1], 10, 160, 0.0, (60.0, 120.0)))
    assert {p.claim for p in pubs if p.time < 110} == {4}  # 5 rounds alone: the others recent


def test_arms_parse_reunion_rules() -> None:
    assert Arm.parse("none+claim+claimplain").rules == ("claim", "claimplain")
    assert str(Arm.parse("heloco:3@late+avg")) == "heloco:3@late+avg"
    with pytest.raises(ValueError, match="RULE"):
        Arm.parse("none+bogus")


def test_drift_is_zero_for_one_point_and_relative_otherwise() -> None:
    a = torch.ones(4)
    assert drift([a, a.clone()]) == 0.0
    assert drift([a, 3 * a]) == pytest.approx(1.0)  # |2a| / mean(|a|, |3a|)


def test_rotate_gives_each_replica_the_backlogs_author_by_author_from_its_next() -> None:
    events = schedule([1, 1, 1, 1], 10, 160, 0.0, (60.0, 120.0), rotate=True)
    pubs, applies = _split(events)
    for replica in range(4):
        taken = [
            pubs[a.publication].author for a in applies if a.replica == replica and a.held_back
        ]
        firsts = list(dict.fromkeys(taken))
        assert firsts == [(replica + k) % 4 for k in (1, 2, 3)] and len(taken) == 18
        assert taken == sorted(taken, key=firsts.index)  # one author's whole backlog at a time
    plain = schedule([1, 1, 1, 1], 10, 160, 0.0, (60.0, 120.0))

    def ids(evs: list[Publication | Apply]) -> list[tuple[int, int, float, bool]]:
        return sorted((a.replica, a.publication, a.time, a.held_back) for a in _split(evs)[1])

    assert ids(plain) == ids(events)  # the same applies, reordered
