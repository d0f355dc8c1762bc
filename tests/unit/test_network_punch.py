"""Which relayed peers a node re-dials so that DCUtR can punch a hole (pure, clock passed in)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dht.network_punch import RedialPolicy, RedialSettings
from dht.reachability import PathKind

ME = "12D3KooWm"  # sorts after "12D3KooWa" and before "12D3KooWz"
LOW, HIGH = "12D3KooWa", "12D3KooWz"
SETTINGS = RedialSettings(settle_s=25.0, relayed_s=10.0, stagger_s=15.0, forget_s=60.0)


def first_redial(policy: RedialPolicy, peer: str, kind: PathKind = "relayed") -> float | None:
    """The first second (0..200) at which `policy` re-dials `peer`, seen `kind` every second."""
    for now in range(200):
        if peer in policy.due(float(now), {peer: kind}):
            return float(now)
    return None


def test_a_relayed_peer_is_redialled_after_the_node_settled_then_every_relayed_s_thrice() -> None:
    policy = RedialPolicy(ME, 0.0, SETTINGS)
    assert first_redial(policy, HIGH) == 25.0  # settle_s after the start (relayed since 0 s)
    assert first_redial(policy, HIGH) == 35.0  # a fresh attempt relayed_s after the last
    assert first_redial(policy, HIGH) == 45.0
    assert first_redial(policy, HIGH) is None  # max_per_peer (3) reached
    assert policy.redials(HIGH) == 3


def test_of_two_relayed_homes_the_one_whose_id_sorts_last_waits_stagger_s_more() -> None:
    assert first_redial(RedialPolicy(ME, 0.0, SETTINGS), LOW) == 40.0
    # a peer first seen relayed late waits relayed_s from then: its DCUtR handler is up
    policy = RedialPolicy(ME, 0.0, SETTINGS)
    policy.due(50.0, {HIGH: "relayed"})
    assert policy.due(59.0, {HIGH: "relayed"}) == []
    assert policy.due(60.0, {HIGH: "relayed"}) == [HIGH]


@pytest.mark.parametrize("kind", ["direct", "holepunched"])
def test_a_peer_with_a_direct_connection_is_never_redialled(kind: PathKind) -> None:
    assert first_redial(RedialPolicy(ME, 0.0, SETTINGS), HIGH, kind) is None


def test_a_peer_gone_for_forget_s_gets_another_chance_and_a_short_gap_keeps_its_wait() -> None:
    policy = RedialPolicy(ME, 0.0, SETTINGS)
    policy.due(0.0, {HIGH: "relayed"})
    policy.due(20.0, {})  # the relay cut the circuit; the peer dials again soon
    assert policy.due(25.0, {HIGH: "relayed"}) == [HIGH]  # relayed since 0 s, not 25 s
    assert policy.due(70.0, {}) == []
    assert policy.due(84.0, {}) == []  # gone since 70 s: not yet forgotten
    assert policy.due(85.0, {}) == []  # forgotten now
    policy.due(100.0, {HIGH: "relayed"})  # it came back (restarted): a new first sight
    assert policy.due(109.0, {HIGH: "relayed"}) == []
    assert policy.due(110.0, {HIGH: "relayed"}) == [HIGH]


def test_at_most_max_per_round_redials_per_call_longest_relayed_first() -> None:
    policy = RedialPolicy("0", 0.0, RedialSettings(max_per_round=2, max_per_peer=1))
    peers = [f"peer{i}" for i in range(5)]
    policy.due(0.0, {p: "relayed" for p in peers[:3]})
    policy.due(5.0, {p: "relayed" for p in peers})
    assert policy.due(25.0, {p: "relayed" for p in peers}) == ["peer0", "peer1"]
    assert policy.due(26.0, {p: "relayed" for p in peers}) == ["peer2", "peer3"]
    assert policy.due(27.0, {p: "relayed" for p in peers}) == ["peer4"]
    assert policy.due(200.0, {p: "relayed" for p in peers}) == []


@pytest.mark.parametrize(
    ("field", "value"),
    [("settle_s", -1.0), ("relayed_s", 4000.0), ("forget_s", 0.0), ("max_per_round", 0)],
)
def test_bad_settings_are_refused_with_their_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        RedialSettings(**{field: value})  # type: ignore[arg-type]


PEERS = ["12D3KooWa", "12D3KooWb", "12D3KooWy", "12D3KooWz"]
KINDS: list[PathKind | None] = ["relayed", "relayed", "direct", "holepunched", None]


@given(
    settings=st.builds(
        RedialSettings,
        settle_s=st.floats(0, 60),
        relayed_s=st.floats(0, 30),
        stagger_s=st.floats(0, 30),
        forget_s=st.floats(1, 120),
        max_per_peer=st.integers(0, 3),
        max_per_round=st.integers(1, 3),
    ),
    steps=st.lists(
        st.tuples(
            st.floats(0.1, 40), st.fixed_dictionaries({p: st.sampled_from(KINDS) for p in PEERS})
        ),
        max_size=40,
    ),
)
def test_redials_are_relayed_peers_after_settling_bounded_per_call_and_per_peer(
    settings: RedialSettings, steps: list[tuple[float, dict[str, PathKind | None]]]
) -> None:
    policy = RedialPolicy("12D3KooWm", 0.0, settings)
    now, redials, last_seen = 0.0, dict.fromkeys(PEERS, 0), dict.fromkeys(PEERS, 0.0)
    for gap, seen in steps:
        now += gap
        paths = {p: k for p, k in seen.items() if k is not None}
        for peer in PEERS:  # a long absence forgets the peer: its count starts again
            if peer not in paths and now - last_seen[peer] >= settings.forget_s:
                redials[peer] = 0
            elif peer in paths:
                last_seen[peer] = now
        chosen = policy.due(now, paths)
        assert len(chosen) == len(set(chosen)) <= settings.max_per_round
        for peer in chosen:
            assert paths[peer] == "relayed"
            assert now >= settings.settle_s
            redials[peer] += 1
            assert redials[peer] <= settings.max_per_peer


@given(st.floats(0, 60), st.floats(0, 30), st.floats(0, 30), st.sampled_from(PEERS))
def test_a_peer_relayed_all_along_is_redialled_within_its_bound(
    settle_s: float, relayed_s: float, stagger_s: float, peer: str
) -> None:
    settings = RedialSettings(settle_s=settle_s, relayed_s=relayed_s, stagger_s=stagger_s)
    policy = RedialPolicy("12D3KooWm", 0.0, settings)
    bound = max(settle_s, relayed_s) + (0.0 if peer > "12D3KooWm" else stagger_s)
    assert first_redial(policy, peer) == math.ceil(bound)  # seen every whole second


def test_a_node_that_cannot_punch_only_watches_and_redials_once_it_can() -> None:
    # a symmetric NAT, or too few observers: p2pd lists no public observed address, and a
    # re-dial would cut a live relayed connection for a punch that cannot start
    policy = RedialPolicy(ME, 0.0, SETTINGS)
    assert all(
        policy.due(float(now), {HIGH: "relayed"}, can_punch=False) == [] for now in range(200)
    )
    assert policy.redials(HIGH) == 0
    # its wait was kept meanwhile: once it can punch, the peer relayed all along is due at once
    assert policy.due(200.0, {HIGH: "relayed"}) == [HIGH]


def test_a_home_that_listed_a_public_address_once_redials_after_autorelay_hides_it() -> None:
    # p2pd lists the home's observed public address for its first ~12 s, then autorelay's
    # address filter leaves only private and relayed ones; DCUtR is served all along
    policy = RedialPolicy(ME, 0.0, replace(SETTINGS, max_per_peer=1))
    listed = {5.0, 6.0, 7.0}
    found = [
        now
        for now in range(200)
        if policy.due(float(now), {HIGH: "relayed"}, can_punch=now in listed) == [HIGH]
    ]
    assert found == [25]
