"""A newcomer refuses a donor's state that the other live peers' heartbeats contradict."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dht.heartbeat import Heartbeat
from dht.reachability import path_rank
from dht.state_check import (
    MAX_DRIFT,
    MAX_OWN_LEAD,
    StateCheckError,
    applied_digest,
    check_donor_state,
    rank_donors,
    unannounced_seqs,
)
from dht.state_transfer import check_with_fresh_heartbeats
from merge.outer import NesterovSGD
from merge.replica import Replica
from merge.sketch import ReplicaSketch, StateSketch, relative_distance

SKETCH = ReplicaSketch(1000, "f" * 64)
PARAMS = torch.linspace(-1, 1, 1000)
APPLIED = {"alice": [1, 2, 3], "bob": [1, 2]}
PARAMS_SKETCH = SKETCH(PARAMS)
NEWCOMER = Replica(torch.zeros(1000), NesterovSGD(lr=0.7, momentum=0.9, numel=1000))


def sketch_state(state: Mapping[str, object]) -> StateSketch:
    return SKETCH.of_state(NEWCOMER, state)


def donor_state(
    params: torch.Tensor = PARAMS, applied: Mapping[str, object] = APPLIED, **outer: Any
) -> dict[str, Any]:
    """A state as a donor serves it; the momentum buffer `buf` zero unless given."""
    momentum = {"kind": "nesterov", "buf": torch.zeros(1000), "count": 0} | outer
    return {"applied": applied, "params": params.clone(), "outer": momentum}


def peer(peer_id: str, *, latest_seq: int = 0, params: torch.Tensor | None = None) -> Heartbeat:
    return Heartbeat(
        peer_id=peer_id, latest_seq=latest_seq, applied_digest=applied_digest(APPLIED),
        sketch=PARAMS_SKETCH if params is None else SKETCH(params), num_applied=5,
    )  # fmt: skip


PEERS = [peer("alice", latest_seq=3), peer("bob", latest_seq=2), peer("donor")]


def test_an_honest_state_passes() -> None:
    state = donor_state()
    check_donor_state(state, "donor", PEERS, sketch_state)


def test_a_donor_whose_state_holds_its_own_unannounced_updates_is_refused() -> None:
    """The donor contradicts its own signed heartbeat: it is not believed."""
    state = donor_state(PARAMS, {**APPLIED, "alice": [1, 2, 3, 1000]})
    with pytest.raises(StateCheckError, match="update 1000 of alice, its donor"):
        check_donor_state(state, "alice", PEERS, sketch_state)


def test_a_donor_whose_heartbeat_lags_its_own_updates_is_believed_within_the_lead() -> None:
    """Heartbeats came 20 s late at 16 nodes on 2 cores: an honest gap donor's state held its
    own updates 5-7 while its last heartbeat said 3 and was refused three times. Within
    MAX_OWN_LEAD they are kept and reported; one beyond it is still a contradiction."""
    donor = peer("alice", latest_seq=3)
    ahead = list(range(1, 5 + MAX_OWN_LEAD))  # up to 3 + 1 + MAX_OWN_LEAD
    verdict = check_donor_state(
        donor_state(PARAMS, {**APPLIED, "alice": ahead}), "alice", [donor, *PEERS[1:]],
        sketch_state,
    )  # fmt: skip
    assert verdict.unannounced == {"alice": list(range(5, 5 + MAX_OWN_LEAD))}
    with pytest.raises(StateCheckError) as refused:
        check_donor_state(
            donor_state(PARAMS, {**APPLIED, "alice": [*ahead, 5 + MAX_OWN_LEAD]}), "alice",
            [donor, *PEERS[1:]], sketch_state,
        )  # fmt: skip
    assert refused.value.check == "own_seq"


def test_one_author_under_reporting_its_seq_vetoes_no_honest_donor() -> None:
    """An adversary signs updates outside its heartbeat (it announces seq 0 and signed 40):
    the honest donor's state holds them, validly signed and validated. It is accepted, with
    those ids kept (the parameters hold them: trimmed, they would be applied twice) and
    reported as unannounced."""
    adversary = [1, *range(5, 41)]
    state = donor_state(PARAMS, {**APPLIED, "mallory": adversary})
    liar = peer("mallory", latest_seq=0)
    verdict = check_donor_state(state, "donor", [*PEERS, liar], sketch_state)
    assert verdict.unannounced == {"mallory": list(range(5, 41))}
    assert verdict.num_unannounced == 36


def test_poisoned_parameters_behind_an_honest_applied_set_are_refused() -> None:
    state = donor_state(PARAMS + 0.5, APPLIED)
    with pytest.raises(StateCheckError, match="parameters differ"):
        check_donor_state(state, "donor", PEERS, sketch_state)


def test_the_donors_own_heartbeat_vouches_for_nothing() -> None:
    liar = peer("donor", params=PARAMS + 0.5)
    state = donor_state(PARAMS + 0.5, APPLIED)
    with pytest.raises(StateCheckError):
        check_donor_state(state, "donor", [*PEERS[:2], liar], sketch_state)


def _fresh_heartbeats(reads: list[list[Heartbeat]]) -> tuple[Callable[[], list[Heartbeat]], Any]:
    """alive_peers() answers reads[0] until poll() moves on to the next read."""
    polls = 0

    def alive() -> list[Heartbeat]:
        return reads[min(polls, len(reads) - 1)]

    async def poll() -> None:
        nonlocal polls
        polls += 1

    return alive, poll


def test_a_state_ahead_of_its_authors_last_heartbeat_passes_once_fresh_ones_announce_it() -> None:
    """Rounds shorter than a heartbeat period: alice's state holds her update 5 while her last
    heartbeat still says 3; her next heartbeat says 5."""
    state = donor_state(PARAMS, {**APPLIED, "alice": [1, 2, 3, 4, 5]})
    late = [peer("alice", latest_seq=3), peer("bob", latest_seq=2)]
    fresh = [peer("alice", latest_seq=5), peer("bob", latest_seq=2)]
    alive, poll = _fresh_heartbeats([late, fresh])
    asyncio.run(
        check_with_fresh_heartbeats(state, "alice", alive, poll, sketch_state, period_s=0.0)
    )


def test_a_state_fresh_heartbeats_still_contradict_is_refused() -> None:
    state = donor_state(PARAMS, {**APPLIED, "alice": [1, 2, 3, 1000]})
    alive, poll = _fresh_heartbeats([PEERS])
    with pytest.raises(StateCheckError, match="update 1000 of alice"):
        asyncio.run(
            check_with_fresh_heartbeats(state, "alice", alive, poll, sketch_state, period_s=0.0)
        )


def test_another_authors_lagging_heartbeat_costs_no_recheck() -> None:
    """Only the donor's own seqs wait for fresh heartbeats; bob's lag is reported at once."""
    state = donor_state(PARAMS, {**APPLIED, "bob": [1, 2, 3, 4]})
    alive, poll = _fresh_heartbeats([PEERS])
    verdict = asyncio.run(
        check_with_fresh_heartbeats(state, "alice", alive, poll, sketch_state, period_s=3600.0)
    )
    assert verdict.unannounced == {"bob": [4]}


AUTHORS = ["alice", "bob", "carol", "donor"]
seqs = st.lists(st.integers(min_value=0, max_value=60), max_size=8, unique=True)


@settings(max_examples=150, deadline=None)
@given(
    applied=st.fixed_dictionaries({a: seqs for a in AUTHORS}),
    announced=st.fixed_dictionaries({a: st.integers(0, 60) for a in AUTHORS}),
    liar=st.sampled_from(AUTHORS[:3]),
    lie=st.integers(0, 60),
)
def test_no_author_but_the_donor_can_turn_an_accepted_state_into_a_refused_one(
    applied: dict[str, list[int]], announced: dict[str, int], liar: str, lie: int
) -> None:
    """Whatever any author other than the donor announces (lower, higher, or nothing at all),
    the verdict on the state is the same; only the reported unannounced ids change, and they
    are exactly that author's seqs above its announced seq + 1."""
    state = donor_state(PARAMS, applied)
    honest = [peer(a, latest_seq=announced[a]) for a in AUTHORS]
    lying = [peer(a, latest_seq=lie if a == liar else announced[a]) for a in AUTHORS]
    silent = [h for h in honest if h.peer_id != liar]

    def verdict(peers: list[Heartbeat]) -> object:
        try:
            return check_donor_state(state, "donor", peers, sketch_state).unannounced
        except StateCheckError:
            return "refused"

    outcomes = [verdict(honest), verdict(lying), verdict(silent)]
    refused = max(applied["donor"], default=0) > announced["donor"] + 1 + MAX_OWN_LEAD
    assert [o == "refused" for o in outcomes] == [refused] * 3
    if not refused:
        above = sorted(s for s in applied[liar] if s > lie + 1)
        lied, silenced = outcomes[1], outcomes[2]
        assert isinstance(lied, dict) and isinstance(silenced, dict)
        assert lied.get(liar, []) == above
        assert liar not in silenced


@settings(max_examples=100, deadline=None)
@given(
    applied=st.dictionaries(st.text(max_size=3), st.lists(st.integers(-5, 100), max_size=6)),
    announced=st.dictionaries(st.text(min_size=1, max_size=3), st.integers(0, 100)),
)
def test_unannounced_seqs_are_exactly_those_above_each_authors_announced_seq(
    applied: dict[str, list[int]], announced: dict[str, int]
) -> None:
    peers = [peer(a, latest_seq=n) for a, n in announced.items()]
    published = {h.peer_id: h.latest_seq for h in peers}
    found = unannounced_seqs(applied, peers)
    for author, seqs in applied.items():
        expected = sorted(s for s in seqs if author in published and s > published[author] + 1)
        assert found.get(author, []) == expected
    assert set(found) <= set(applied)


def test_replicas_that_applied_the_same_updates_in_other_orders_are_not_told_apart() -> None:
    """Their params differ by the momentum tail (more than max_drift here); where they come to
    rest does not, and that is what heartbeats sketch and the newcomer compares."""
    updates = [torch.randn(1000, generator=torch.Generator().manual_seed(i)) for i in range(12)]
    replicas = []
    for order in (range(12), [*range(8), 11, 9, 10, 8]):
        optimizer = NesterovSGD(lr=0.7, momentum=0.9, numel=1000)
        params = PARAMS.clone()
        for i in order:
            optimizer.step(params, updates[i].mul(0.1), 1.0, learners=2)
        replicas.append({**donor_state(params), "outer": optimizer.state_dict()})
    one, other = (sketch_state(r) for r in replicas)
    tails = relative_distance(one.as_is, other.as_is)
    assert tails is not None and tails > MAX_DRIFT  # the tails differ
    honest = Heartbeat(
        peer_id="alice", latest_seq=3, applied_digest=applied_digest(APPLIED),
        sketch=one.settled, num_applied=5,
    )  # fmt: skip
    check_donor_state(replicas[1], "donor", [honest, PEERS[1]], sketch_state)


def test_an_offset_hidden_in_the_momentum_is_refused() -> None:
    """Params moved by X and a momentum that will take X back: the settled point is honest,
    but a newcomer would train from the offset params for many rounds."""
    offset = torch.full((1000,), 5.0)
    rest_per_buf = -0.7 * 0.9 * 0.9 / (1 - 0.9)
    state = donor_state(PARAMS + offset, buf=-offset / rest_per_buf, count=3)
    assert sketch_state(state).settled == pytest.approx(SKETCH(PARAMS), abs=1e-5)
    with pytest.raises(StateCheckError, match="momentum would still move"):
        check_donor_state(state, "donor", PEERS, sketch_state)


def test_a_malformed_momentum_is_refused_not_raised() -> None:
    state = donor_state(buf=torch.zeros(7))
    with pytest.raises(StateCheckError, match="malformed"):
        check_donor_state(state, "donor", PEERS, sketch_state)


def stranger(peer_id: str, params: torch.Tensor, num_applied: int = 4) -> Heartbeat:
    """A live peer with another applied set than the donor's (a swarm still training)."""
    return Heartbeat(
        peer_id=peer_id, applied_digest="cd" * 32, sketch=SKETCH(params), num_applied=num_applied
    )


def test_a_lone_donor_near_the_other_replicas_passes() -> None:
    """No peer reports the donor's applied set, but its model is a few updates from theirs."""
    nearby = PARAMS + 0.02 * torch.randn(1000, generator=torch.Generator().manual_seed(1))
    check_donor_state(donor_state(), "donor", [stranger("carol", nearby)], sketch_state)


def test_a_lone_donor_serving_a_noised_model_is_refused() -> None:
    """bench.attack's poisoner: noise of the params' own norm, an applied set nobody shares."""
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    poisoned = PARAMS + noise * float(PARAMS.norm()) / 1000**0.5
    with pytest.raises(StateCheckError, match="from half the other trained live peers"):
        check_donor_state(donor_state(poisoned), "donor", [stranger("bob", PARAMS)], sketch_state)


def test_peers_at_genesis_do_not_refuse_a_trained_donor() -> None:
    """A second newcomer, still at the untrained model, is no yardstick for a donor."""
    far = -3 * PARAMS
    check_donor_state(donor_state(), "donor", [stranger("fresh", far, 0)], sketch_state)
    with pytest.raises(StateCheckError):
        check_donor_state(donor_state(), "donor", [stranger("bob", far)], sketch_state)


def donor(peer_id: str, num_applied: int, digest: str, serves: bool = True) -> Heartbeat:
    return Heartbeat(
        peer_id=peer_id, num_applied=num_applied, applied_digest=digest * 32, serves_state=serves
    )


def test_a_donor_boasting_progress_comes_after_the_corroborated_ones() -> None:
    liar = donor("mallory", 5000, "ee")
    honest = [donor("alice", 40, "aa"), donor("bob", 40, "aa"), donor("carol", 42, "cc")]
    ranked = [h.peer_id for h in rank_donors([liar, *honest, donor("dave", 3, "dd")], 10)]
    assert ranked == ["alice", "bob", "mallory", "carol"]


@given(
    st.lists(
        st.tuples(st.integers(0, 50), st.sampled_from(["aa", "bb", "cc"]), st.booleans()),
        max_size=12,
    ),
    st.integers(0, 50),
)
def test_donors_are_ahead_serve_state_and_corroborated_ones_lead(
    claims: list[tuple[int, str, bool]], num_applied: int
) -> None:
    alive = [donor(f"p{i}", n, d, serves) for i, (n, d, serves) in enumerate(claims)]
    ranked = rank_donors(alive, num_applied)
    assert all(h.serves_state and h.num_applied > num_applied for h in ranked)
    assert len(ranked) == sum(s and n > num_applied for n, _, s in claims)
    shared = [
        sum((g.num_applied, g.applied_digest) == (h.num_applied, h.applied_digest) for g in alive)
        > 1
        for h in ranked
    ]
    assert shared == sorted(shared, reverse=True)


def test_behind_nat_a_donor_on_a_live_connection_is_tried_before_an_unconnected_one() -> None:
    """The chaos run's restart tried first a home it had no connection to (its relay slot
    gone: NO_RESERVATION); a donor on a direct connection, then a relayed one, comes first
    now, within its corroboration group: a connected liar still waits behind them."""
    homes = [donor("home1", 40, "aa"), donor("home2", 40, "aa"), donor("public", 40, "aa")]
    liar = donor("mallory", 5000, "ee")
    paths = {"public": "direct", "home2": "relayed", "mallory": "direct"}
    ranked = rank_donors([*homes, liar], 10, path_rank=lambda p: path_rank(paths.get(p)))  # type: ignore[arg-type]
    assert [h.peer_id for h in ranked] == ["public", "home2", "home1", "mallory"]
    assert [h.peer_id for h in rank_donors([*homes, liar], 10)][-1] == "mallory"


@given(
    st.lists(
        st.tuples(
            st.integers(0, 50),
            st.sampled_from(["aa", "bb", "cc"]),
            st.sampled_from([None, "direct", "holepunched", "relayed"]),
        ),
        max_size=12,
    ),
    st.integers(0, 50),
)
def test_paths_reorder_donors_only_within_their_corroboration_group(
    claims: list[tuple[int, str, str | None]], num_applied: int
) -> None:
    alive = [donor(f"p{i}", n, d) for i, (n, d, _) in enumerate(claims)]
    paths = {f"p{i}": kind for i, (_, _, kind) in enumerate(claims)}
    plain = rank_donors(alive, num_applied)
    ranked = rank_donors(alive, num_applied, path_rank=lambda p: path_rank(paths[p]))  # type: ignore[arg-type]
    assert sorted(h.peer_id for h in ranked) == sorted(h.peer_id for h in plain)

    def shared(h: Heartbeat) -> bool:
        return (
            sum(
                (g.num_applied, g.applied_digest) == (h.num_applied, h.applied_digest)
                for g in alive
            )
            > 1
        )

    groups = [shared(h) for h in ranked]
    assert groups == sorted(groups, reverse=True)  # corroborated first, whatever the paths
    for corroborated in (True, False):
        ranks = [path_rank(paths[h.peer_id]) for h in ranked if shared(h) == corroborated]  # type: ignore[arg-type]
        assert ranks == sorted(ranks)  # within a group: direct, then relayed, then none


def test_one_accomplice_heartbeat_does_not_vouch_against_two_honest_peers() -> None:
    """A second key of the poisoner reports the poisoned applied set and its sketch: the
    exact check passes on it, but the state is far from both honest replicas."""
    noise = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    poisoned = PARAMS + noise * float(PARAMS.norm()) / 1000**0.5
    accomplice = Heartbeat(
        peer_id="mallory2", applied_digest=applied_digest(APPLIED), sketch=SKETCH(poisoned),
        num_applied=5,
    )  # fmt: skip
    honest = [stranger("carol", PARAMS), stranger("dave", PARAMS)]
    with pytest.raises(StateCheckError, match="half the other trained"):
        check_donor_state(donor_state(poisoned), "donor", [accomplice, *honest], sketch_state)
    # ... and one lying heartbeat far from everyone vetoes no honest donor
    liar = stranger("mallory", poisoned)
    check_donor_state(donor_state(), "donor", [liar, stranger("carol", PARAMS)], sketch_state)
