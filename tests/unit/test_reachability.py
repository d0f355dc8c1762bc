"""Relay limits, p2pd's relay flags, and which path each connection took (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.nat import nft_rules
from dht.reachability import (
    PATH_KINDS,
    PathBook,
    RelayLimits,
    connections_by_peer,
    daemon_env,
    daemon_flags,
    is_public,
    path_rank,
    paths_label,
    relay_of,
    shareable,
    tuned_p2p,
)

RELAY = "12D3KooWNdCAR3NwA13FW74d2hURfeBQ4RaTmTorkqWxQcvHGnZw"
DIRECT = "/ip4/11.64.0.101/tcp/4000"
LAN = "/ip4/192.168.1.11/tcp/4000"
RELAYED = f"/ip4/11.64.0.10/tcp/4100/p2p/{RELAY}/p2p-circuit"
BOOTSTRAP = f"/ip4/11.64.0.10/tcp/4100/p2p/{RELAY}"


def test_relay_limits_become_p2pd_flags() -> None:
    limits = RelayLimits(max_circuits=4, max_bytes=50_000_000, max_duration_s=90.0)
    assert limits.daemon_flags() == {
        "relayMaxCircuits": "4",
        "relayDataLimit": "50000000",
        "relayTimeLimit": "90s",
    }


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("max_circuits", 0, "--relay-max-circuits"),
        ("max_bytes", 10, "--relay-max-mb"),
        ("max_duration_s", 1.0, "--relay-max-duration"),
    ],
)
def test_a_bad_relay_limit_names_its_flag(field: str, value: float, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        RelayLimits(**{field: value})  # type: ignore[arg-type]


def test_a_nated_node_uses_its_bootstrap_peers_as_static_relays_without_discovery() -> None:
    flags = daemon_flags(use_auto_relay=True, initial_peers=[BOOTSTRAP], limits=RelayLimits())
    assert flags["relayDiscovery"] == "0"


def test_the_first_node_keeps_relay_discovery_p2pd_needs_it_without_static_relays() -> None:
    for auto_relay, peers in ((True, []), (False, [BOOTSTRAP])):
        flags = daemon_flags(use_auto_relay=auto_relay, initial_peers=peers, limits=RelayLimits())
        assert "relayDiscovery" not in flags


def test_relay_of_names_the_relay_not_the_target() -> None:
    assert relay_of(f"{RELAYED}/p2p/12D3KooWtarget") == RELAY
    assert relay_of(DIRECT) is None


def test_a_peer_seen_relayed_then_direct_was_hole_punched() -> None:
    book = PathBook()
    book.observe({"a": [RELAYED], "b": [DIRECT]})
    assert (book.path("a"), book.path("b")) == ("relayed", "direct")
    book.observe({"a": [RELAYED, DIRECT], "b": [DIRECT]})
    assert book.path("a") == "holepunched"
    assert book.counts() == {"direct": 1, "holepunched": 1, "relayed": 0}


def test_a_peer_listed_once_per_connection_keeps_its_direct_one() -> None:
    # p2pd lists each connection apart: the relayed one listed last must not hide the direct
    entries = [("a", [DIRECT]), ("b", [RELAYED]), ("a", [RELAYED])]
    assert connections_by_peer(entries) == {"a": [DIRECT, RELAYED], "b": [RELAYED]}
    book = PathBook()
    book.observe(connections_by_peer([("a", [RELAYED])]))
    book.observe(connections_by_peer(entries))
    assert (book.path("a"), book.path("b")) == ("holepunched", "relayed")


@given(st.lists(st.tuples(st.sampled_from("abc"), st.lists(st.sampled_from([DIRECT, RELAYED])))))
def test_grouping_connections_loses_no_address(entries: list[tuple[str, list[str]]]) -> None:
    grouped = connections_by_peer(entries)
    assert set(grouped) == {peer for peer, _ in entries}
    for peer, addrs in grouped.items():
        assert addrs == [a for p, listed in entries if p == peer for a in listed]


def test_a_peer_that_disconnected_has_no_path() -> None:
    book = PathBook()
    book.observe({"a": [DIRECT]})
    book.observe({})
    assert book.path("a") is None
    assert book.counts() == dict.fromkeys(PATH_KINDS, 0)


def test_a_punch_faster_than_one_observation_counts_by_the_relayed_connection_beside_it() -> None:
    # DCUtR keeps the relayed connection open: both are listed at the first observation
    book = PathBook()
    book.observe({"a": [DIRECT, RELAYED]})
    assert book.path("a") == "holepunched"
    book.observe({"a": [DIRECT]})  # the relay closed its circuit later
    assert book.path("a") == "holepunched"


def test_a_punch_before_the_first_observation_counts_when_both_sides_are_behind_nats() -> None:
    # session 16: two homes punched 15 s after they started, the relayed connection was gone
    # by the first observation, and every fetch was counted "direct"
    book = PathBook()
    book.observe({"a": [DIRECT], "pub": [BOOTSTRAP]})
    assert book.path("a") == "direct"  # this node not known to be behind a NAT yet
    book.observe({"a": [DIRECT], "pub": [BOOTSTRAP], "lan": [LAN]}, nat_peers={"a", "lan"})
    assert book.current() == {"a": "holepunched", "pub": "direct", "lan": "direct"}


@given(
    connections=st.dictionaries(
        st.sampled_from("abcd"), st.lists(st.sampled_from([DIRECT, RELAYED, LAN]), max_size=3)
    ),
    nat_peers=st.sets(st.sampled_from("abcd")),
)
def test_a_peer_not_behind_a_nat_nor_ever_relayed_is_never_counted_punched(
    connections: dict[str, list[str]], nat_peers: set[str]
) -> None:
    book = PathBook()
    book.observe(connections, nat_peers)
    for peer, kind in book.current().items():
        if kind == "holepunched":
            assert peer in nat_peers or RELAYED in connections[peer]
            assert DIRECT in connections[peer]  # on a public address, never a LAN one alone


def test_a_lan_neighbour_first_seen_relayed_is_direct_not_punched() -> None:
    # two homes behind one router: no NAT between them to punch through
    book = PathBook()
    book.observe({"a": [RELAYED]})
    book.observe({"a": [LAN, RELAYED]})
    assert book.path("a") == "direct"


def test_only_globally_routable_addresses_are_public() -> None:
    assert is_public(DIRECT) and is_public("/ip6/2a00:1450::1/tcp/1")
    for maddr in (LAN, "/ip4/127.0.0.1/tcp/1", "/ip4/100.64.0.3/tcp/1", "/dns/x/tcp/1", "/ip4/x"):
        assert not is_public(maddr), maddr


@given(
    st.lists(
        st.dictionaries(
            st.sampled_from("abcdef"),
            st.lists(st.sampled_from([DIRECT, RELAYED, LAN]), max_size=3),
            max_size=6,
        ),
        min_size=1,
        max_size=6,
    )
)
def test_every_connected_peer_is_counted_on_exactly_one_path(
    rounds: list[dict[str, list[str]]],
) -> None:
    book = PathBook()
    relayed_before: set[str] = set()
    for connections in rounds:
        book.observe(connections)
        connected = {p for p, addrs in connections.items() if addrs}
        assert sum(book.counts().values()) == len(connected)
        for peer in connected:
            addrs = connections[peer]
            if RELAYED in addrs:
                relayed_before.add(peer)
            if all(a == RELAYED for a in addrs):
                assert book.path(peer) == "relayed"
            else:
                punched = peer in relayed_before and DIRECT in addrs
                assert book.path(peer) == ("holepunched" if punched else "direct")


def test_the_cone_nat_keeps_ports_and_the_symmetric_one_randomises_them() -> None:
    assert "masquerade\n" in nft_rules("cone")
    assert "masquerade random,fully-random" in nft_rules("symmetric")
    for kind in ("cone", "symmetric"):
        assert "ct state established,related accept" in nft_rules(kind)
    with pytest.raises(ValueError, match="cone, symmetric"):
        nft_rules("full-cone")


def test_join_turns_its_relay_flags_into_limits_and_refuses_bad_ones() -> None:
    from node.config import JoinConfig

    config = JoinConfig(relay_max_circuits=4, relay_max_mb=50.0, relay_max_duration=90.0)
    assert config.relay_limits == RelayLimits(
        max_circuits=4, max_bytes=50_000_000, max_duration_s=90.0
    )
    with pytest.raises(ValueError, match="--relay-max-mb"):
        JoinConfig(relay_max_mb=0.0)


def test_paths_label_names_the_paths_in_use() -> None:
    assert paths_label({"direct": 1, "holepunched": 0, "relayed": 2}) == "1 direct, 2 relayed"
    assert paths_label({}) == "-"  # a peer of an earlier version reports none
    assert paths_label(dict.fromkeys(PATH_KINDS, 0)) == "-"


LOOPBACK = "/ip4/127.0.0.1/tcp/4000"


@given(st.lists(st.sampled_from([DIRECT, RELAYED, LOOPBACK]), max_size=40))
def test_a_heartbeat_keeps_the_addresses_a_distant_peer_can_use_within_its_limit(
    maddrs: list[str],
) -> None:
    kept = shareable(maddrs, 16)
    # relayed first, then direct ones, loopback only where room is left
    assert kept == sorted(maddrs, key=[RELAYED, DIRECT, LOOPBACK].index)[:16]


def test_a_live_connection_ranks_a_peer_before_one_this_node_must_dial() -> None:
    ranks = [path_rank(k) for k in ("direct", "holepunched", "relayed", None)]
    assert ranks == [0, 0, 1, 2]


def test_tuned_p2p_adds_flags_and_runs_p2pd_under_env_with_the_variables_given() -> None:
    # P2P.create calls it on the instance it is building
    plain = object.__new__(tuned_p2p({"relayDataLimit": "5"}))
    assert plain._make_process_args("p2pd", relay=True) == ["p2pd", "-relay=1", "-relayDataLimit=5"]
    scheduled = object.__new__(tuned_p2p({}, env={"GOMAXPROCS": "1"}))
    assert scheduled._make_process_args("p2pd") == ["env", "GOMAXPROCS=1", "p2pd"]


def test_only_a_node_told_it_is_public_runs_p2pd_on_one_scheduler_thread() -> None:
    # the configured relay service then registers after the default one (docs/nat.md)
    assert daemon_env(force_public=True) == {"GOMAXPROCS": "1"}
    assert daemon_env(force_public=False) == {}
