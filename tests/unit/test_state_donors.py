"""Whether, from whom and for how long a joining node downloads a state (dht.state_donors), and
the donor order that prefers its own learner group (dht.state_check.rank_donors)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from dht.grouping import peer_bits
from dht.heartbeat import Heartbeat
from dht.state_check import rank_donors
from dht.state_donors import (
    SKIP_REASONS,
    DonorLook,
    JoinDownload,
    Skipped,
    TryDonors,
    Wait,
    in_group,
    look,
    own_group,
    spread_key,
)
from dht.state_refusal import StateRefusal
from dht.state_transfer import StateTransfer

RUN = "run"


def beat(peer_id: str, num_applied: int, *, serves: bool = True, digest: str = "aa",
         bits: int | None = None, epoch: int | None = None) -> Heartbeat:  # fmt: skip
    return Heartbeat(
        peer_id=peer_id, num_applied=num_applied, applied_digest=digest * 32,
        serves_state=serves, group_bits=bits, group_epoch=epoch,
    )  # fmt: skip


def seen(
    donors: tuple[str, ...] = (), *, live: int | None = None, silent_ahead: int = 0, best: int = 0
) -> DonorLook:
    return DonorLook(
        num_applied=3, num_live=len(donors) if live is None else live,
        num_silent_ahead=silent_ahead, best_applied=best, num_ahead_not_serving=0, donors=donors,
    )  # fmt: skip


def plan(expects_peers: bool = True, patience_s: float = 60.0) -> JoinDownload:
    return JoinDownload(
        started_at=0.0, period_s=1.0, expects_peers=expects_peers, patience_s=patience_s
    )


def refusal(donor: str, reason: str) -> StateRefusal:
    return StateRefusal(donor, reason, reason, "detail")


def test_a_first_node_skips_at_once_and_says_no_live_peers() -> None:
    step = plan(expects_peers=False).next(seen(), 0.0)
    assert isinstance(step, Skipped) and step.reason == "no_live_peers"
    assert "no_live_peers" in step.line


def test_a_joining_node_waits_for_a_first_heartbeat_then_says_no_live_peers() -> None:
    joining = plan()
    steps = [joining.next(seen(), now) for now in (1.0, 2.0, 3.0, 3.5, 4.5)]
    assert all(isinstance(step, Wait) for step in steps[:-1])
    step = steps[-1]  # past two periods and two seconds, and four looks
    assert isinstance(step, Skipped) and step.reason == "no_live_peers"
    assert step.waited_s == 4.5


def test_a_poll_slower_than_the_wait_still_gets_its_looks() -> None:
    """On a loaded machine one read of the heartbeat shards outlasted the whole wait."""
    joining = plan()
    assert isinstance(joining.next(seen(), 0.0), Wait)
    assert isinstance(joining.next(seen(), 9.0), Wait)  # the first poll returned empty, late
    assert joining.next(seen(("a",), best=9), 12.0) == TryDonors(("a",))


def test_live_peers_none_ahead_say_no_donor_ahead_with_the_numbers() -> None:
    step = plan().next(seen(live=2, best=3), 0.5)
    assert isinstance(step, Skipped) and step.reason == "no_donor_ahead"
    assert step.numbers["num_live"] == 2 and step.numbers["best_applied"] == 3


def test_silent_peers_that_were_ahead_are_waited_for_a_few_periods() -> None:
    """A heartbeat late under load: the peer looks silent for a moment, not dead."""
    joining = plan()
    assert isinstance(joining.next(seen(live=1, silent_ahead=1), 1.0), Wait)
    assert joining.next(seen(("a",), best=9), 3.0) == TryDonors(("a",))
    stale = plan()
    step = stale.next(seen(live=1, silent_ahead=1), 10.0)
    assert isinstance(step, Skipped) and step.reason == "no_donor_ahead"
    assert step.numbers["num_silent_ahead"] == 1


def test_unreachable_donors_are_tried_again_until_the_patience_runs_out() -> None:
    joining = plan(patience_s=30.0)
    now = 0.0
    passes = 0
    while isinstance(step := joining.next(seen(("a", "b"), best=9), now), TryDonors):
        passes += 1
        for donor in step.donors:
            joining.failed(refusal(donor, "unreachable"))
        now += joining.pause_s()
    assert isinstance(step, Skipped) and step.reason == "timed_out"
    assert passes >= 3 and step.refusals == {"unreachable": 2 * passes}
    assert now < 30.0 + 8.0  # bounded: the last pause ends at most MAX_PAUSE_S past it


def test_a_donor_that_sent_a_bad_state_is_not_asked_again() -> None:
    joining = plan()
    assert joining.next(seen(("liar", "b"), best=9), 0.0) == TryDonors(("liar", "b"))
    joining.failed(refusal("liar", "bad_state"))
    joining.failed(refusal("b", "busy"))
    assert joining.next(seen(("liar", "b"), best=9), 1.0) == TryDonors(("b",))
    joining.failed(refusal("b", "bad_state"))
    step = joining.next(seen(("liar", "b"), best=9), 2.0)
    assert isinstance(step, Skipped) and step.reason == "all_refused"
    assert step.refusals == {"bad_state": 2, "busy": 1}


@settings(max_examples=200, deadline=None)
@given(
    looks=st.lists(
        st.tuples(
            st.lists(st.sampled_from("abcd"), max_size=4, unique=True),
            st.integers(0, 3),
            st.integers(0, 2),
            st.sampled_from(["bad_state", "busy", "unreachable"]),
            st.floats(0.0, 20.0),
        ),
        min_size=1,
        max_size=60,
    ),
    expects=st.booleans(),
)
def test_every_join_ends_in_a_bounded_time_with_a_reason(
    looks: list[tuple[list[str], int, int, str, float]], expects: bool
) -> None:
    """Whatever the peers show, pass after pass: never a donor that sent a bad state twice,
    and once past the patience (and the pause after a pass), a skip with a known reason."""
    joining = plan(expects_peers=expects, patience_s=30.0)
    now, bad = 0.0, set()
    for donors, live, silent, reason, gap in looks * 10:
        step = joining.next(seen(tuple(donors), live=live + len(donors), silent_ahead=silent), now)
        if isinstance(step, Skipped):
            assert step.reason in SKIP_REASONS
            return
        if isinstance(step, TryDonors):
            assert not bad & set(step.donors)
            for donor in step.donors:
                joining.failed(refusal(donor, reason))
                if reason == "bad_state":
                    bad.add(donor)
            now += joining.pause_s()
        else:
            now += step.seconds
        now += gap
        assert now < 30.0 + 8.0 + 20.0 + 20.0 or isinstance(step, Skipped)
    assert now < 30.0 + 8.0 + 20.0 + 20.0


def test_look_counts_what_it_saw() -> None:
    alive = [beat("a", 9), beat("b", 2), beat("c", 7, serves=False)]
    found = look(alive, [beat("d", 12), beat("e", 1)], 3, rank_donors(alive, 3))
    assert found.donors == ("a",)
    assert (found.num_live, found.best_applied, found.num_ahead_not_serving) == (3, 9, 1)
    assert found.num_silent_ahead == 1


def ids_in(prefix: str, count: int, *, outside: bool = False) -> list[str]:
    found, i = [], 0
    while len(found) < count:
        peer = f"peer{i}"
        if peer_bits(RUN, peer).startswith(prefix) != outside:
            found.append(peer)
        i += 1
    return found


def test_own_group_follows_the_bits_most_live_peers_report_at_their_newest_epoch() -> None:
    me = "me"
    alive = [beat("x", 1, bits=2, epoch=4), beat("y", 1, bits=2, epoch=4),
             beat("z", 1, bits=1, epoch=4), beat("old", 1, bits=3, epoch=3)]  # fmt: skip
    assert own_group(RUN, me, alive) == peer_bits(RUN, me)[:2]
    assert own_group(RUN, me, [beat("x", 1)]) is None  # groups off


@settings(max_examples=100, deadline=None)
@given(
    me=st.text("abcdef0123", min_size=3, max_size=8),
    num_in=st.integers(1, 4),
    num_out=st.integers(0, 4),
    applied=st.lists(st.integers(0, 40), min_size=8, max_size=8),
    mine=st.integers(0, 20),
)
def test_with_a_fit_own_group_donor_the_first_donor_is_in_the_group(
    me: str, num_in: int, num_out: int, applied: list[int], mine: int
) -> None:
    """And never a donor that is not ahead, in the group or not."""
    prefix = peer_bits(RUN, me)[:1]
    members, others = ids_in(prefix, num_in), ids_in(prefix, num_out, outside=True)
    alive = [beat(p, applied[i], bits=1, epoch=2) for i, p in enumerate(members + others)]
    group = own_group(RUN, me, alive)
    assert group == prefix
    ranked = rank_donors(
        alive, mine, lambda p: 2, prefer=in_group(RUN, group), spread=lambda d: spread_key(me, d)
    )
    assert all(h.num_applied > mine for h in ranked)
    fit = [h for h in alive if h.peer_id in members and h.num_applied > mine]
    if fit:
        assert ranked[0].peer_id in members
    else:
        assert all(h.peer_id in others for h in ranked)


def test_joining_nodes_spread_over_equally_fit_donors() -> None:
    donors = [beat(p, 10) for p in ("a", "b", "c")]
    firsts = {
        rank_donors(donors, 0, spread=lambda d, me=me: spread_key(me, d))[0].peer_id
        for me in (f"joiner{i}" for i in range(40))
    }
    assert firsts == {"a", "b", "c"}
    # the spread only breaks ties: corroborated donors still come first for everyone
    crowd = [beat(p, 10, digest=p * 2) for p in "abc"] + [beat(p, 10, digest="dd") for p in "de"]
    firsts = {
        rank_donors(crowd, 0, spread=lambda d, me=me: spread_key(me, d))[0].peer_id
        for me in (f"joiner{i}" for i in range(40))
    }
    assert firsts == {"d", "e"}


def test_the_join_download_asks_its_own_group_first() -> None:
    """StateTransfer's donors (its network and membership replaced): a member of this node's
    group comes first although another group's member is further ahead."""
    me = "joiner"
    prefix = peer_bits(RUN, me)[:1]
    (member,), (other,) = ids_in(prefix, 1), ids_in(prefix, 1, outside=True)
    alive = [beat(other, 30, bits=1, epoch=3), beat(member, 20, bits=1, epoch=3)]

    async def read_paths() -> None:
        return None

    node = object.__new__(StateTransfer)
    node.network = SimpleNamespace(  # type: ignore[assignment]
        identity=SimpleNamespace(peer_id=me),
        read_paths=read_paths,
        paths=SimpleNamespace(path=lambda peer: None),
    )
    node.config = SimpleNamespace(run_id=RUN)  # type: ignore[assignment]
    node.replica = SimpleNamespace(num_applied=5)  # type: ignore[assignment]
    donors = asyncio.run(node._donors(alive))
    assert [h.peer_id for h in donors] == [member, other]
    ungrouped = [beat(other, 30), beat(member, 20)]
    assert [h.peer_id for h in asyncio.run(node._donors(ungrouped))] == [other, member]
