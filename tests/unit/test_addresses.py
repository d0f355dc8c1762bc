"""Multiaddrs as users paste them: what a node accepts, what it refuses, and how it says so."""

from __future__ import annotations

import shlex

import pytest
from multiaddr import Multiaddr

from dht.addresses import (
    AddressError,
    join_hint,
    listen_maddrs,
    parse_announce_maddr,
    parse_peer_maddr,
    peer_id_of,
    without_peer_id,
)

PEER = "12D3KooWCqqAUtj3nhxBBBaLzrKhE37eruyDVwb8GBTnxvbRGgDx"
RELAY = "QmSoLnSGccFuZQJzRadHn95W2CrSFmZuTdDWP8HXaHca9z"


@pytest.mark.parametrize(
    "text",
    [
        f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER}",
        f"/ip6/::1/tcp/31337/p2p/{PEER}",
        f"/dns4/node.example.org/tcp/31337/p2p/{PEER}",
        f"/dns/node.example.org/tcp/443/ws/p2p/{PEER}",
        f"/ip4/203.0.113.7/udp/31337/quic-v1/p2p/{PEER}",
        f"/ip4/203.0.113.7/udp/31337/quic/p2p/{PEER}",
        f"/ip4/203.0.113.7/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}",
    ],
)
def test_peer_maddr_accepts_dialable_addresses_and_keeps_the_target_id(text: str) -> None:
    maddr = parse_peer_maddr(f"  {text}\n")
    assert str(maddr) == text
    assert peer_id_of(maddr) == PEER


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("garbage", "--peers: 'garbage' is not a valid multiaddr (unknown protocol: garbage)"),
        (
            "/ip4/1.2.3/tcp/1",
            "--peers: '/ip4/1.2.3/tcp/1' is not a valid multiaddr (base address '1.2.3' is not",
        ),
        (f"/ip4/1.2.3.4/tcp/70000/p2p/{PEER}", "is not a valid multiaddr (integer not in range"),
        ("/ip4/1.2.3.4/tcp/1/p2p/notapeer", "is not a valid multiaddr (Invalid CID: notapeer"),
        (
            "/ip4/127.0.0.1/tcp/31337",
            "--peers: '/ip4/127.0.0.1/tcp/31337' has no /p2p/<peer id> part; "
            "copy the full address the first node printed",
        ),
        (f"/p2p/{PEER}", "has no address to dial"),
        (f"/ip4/1.2.3.4/udp/5/p2p/{PEER}", "has no address to dial"),
        (f"/ip4/1.2.3.4/p2p/{PEER}", "has no address to dial"),
        (f"/ip4/1.2.3.4/tcp/0/p2p/{PEER}", "has port 0, which cannot be dialled"),
        ("", "has no address to dial"),
    ],
)
def test_peer_maddr_refuses_with_a_message_naming_the_text(text: str, message: str) -> None:
    with pytest.raises(AddressError) as info:
        parse_peer_maddr(text)
    assert message in str(info.value)
    assert f"'{text}'" in str(info.value)


def test_announce_maddr_needs_no_peer_id_and_drops_a_pasted_one() -> None:
    assert str(parse_announce_maddr("/ip4/203.0.113.7/tcp/31337")) == "/ip4/203.0.113.7/tcp/31337"
    pasted = parse_announce_maddr(f"/dns4/node.example.org/tcp/31337/p2p/{PEER}")
    assert str(pasted) == "/dns4/node.example.org/tcp/31337"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("203.0.113.7:31337", "--announce: '203.0.113.7:31337' is not a valid multiaddr"),
        ("/ip4/203.0.113.7", "has no address to dial"),
        ("/ip4/203.0.113.7/tcp/0", "has port 0"),
    ],
)
def test_announce_maddr_refuses_what_peers_cannot_dial(text: str, message: str) -> None:
    with pytest.raises(AddressError, match="^--announce: ") as info:
        parse_announce_maddr(text)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("0.0.0.0", 31337, "/ip4/0.0.0.0/tcp/31337"),
        ("127.0.0.1", 0, "/ip4/127.0.0.1/tcp/0"),
        ("::", 65535, "/ip6/::/tcp/65535"),
        ("0:0:0:0:0:0:0:1", 1, "/ip6/::1/tcp/1"),
    ],
)
def test_listen_maddrs_for_host_and_port(host: str, port: int, expected: str) -> None:
    assert listen_maddrs(host, port) == [expected]
    assert str(Multiaddr(expected)) == expected


@pytest.mark.parametrize("host", ["localhost", "LocalHost", " localhost "])
def test_listen_maddrs_take_localhost_as_the_loopback_address(host: str) -> None:
    assert listen_maddrs(host, 0) == ["/ip4/127.0.0.1/tcp/0"]


@pytest.mark.parametrize("host", ["1.2.3", "", "example.org", "localhost.example"])
def test_listen_maddrs_refuses_a_host_that_is_not_an_ip(host: str) -> None:
    message = (
        f"--host must be an IP address such as 0.0.0.0 or 127.0.0.1 (or localhost), got '{host}'"
    )
    with pytest.raises(AddressError) as info:
        listen_maddrs(host, 31337)
    assert str(info.value) == message


@pytest.mark.parametrize("port", [-1, 65536])
def test_listen_maddrs_refuses_a_port_out_of_range(port: int) -> None:
    with pytest.raises(AddressError, match=f"--port must be between 0 and 65535, got {port}"):
        listen_maddrs("127.0.0.1", port)


def test_peer_id_round_trip() -> None:
    full = parse_peer_maddr(f"/ip4/127.0.0.1/tcp/31337/p2p/{PEER}")
    bare = without_peer_id(full)
    assert str(bare) == "/ip4/127.0.0.1/tcp/31337"
    assert without_peer_id(bare) == bare
    assert bare.encapsulate(Multiaddr(f"/p2p/{peer_id_of(full)}")) == full
    assert parse_peer_maddr(str(full)) == full


def test_without_peer_id_keeps_the_relay_of_a_relayed_address() -> None:
    relayed = parse_peer_maddr(f"/ip4/203.0.113.7/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}")
    assert str(without_peer_id(relayed)) == f"/ip4/203.0.113.7/tcp/4001/p2p/{RELAY}/p2p-circuit"


def test_peer_id_of_an_address_without_one_is_an_error() -> None:
    with pytest.raises(AddressError, match="does not end with /p2p/<peer id>"):
        peer_id_of(Multiaddr("/ip4/127.0.0.1/tcp/31337"))


def test_join_hint_is_a_shell_command_that_splits_back_into_the_arguments() -> None:
    maddrs = [f"/ip4/203.0.113.7/tcp/31337/p2p/{PEER}", f"/ip6/::1/tcp/31337/p2p/{PEER}"]
    extra = ["--run-id", "my run", "--model", "tiny"]
    hint = join_hint(maddrs, extra)
    assert hint.startswith(f"diloco-node join --peers {maddrs[0]} {maddrs[1]} ")
    assert shlex.split(hint) == ["diloco-node", "join", "--peers", *maddrs, *extra]
    assert all(parse_peer_maddr(m) for m in shlex.split(hint)[3:5])


def test_join_hint_without_addresses_is_an_error() -> None:
    with pytest.raises(AddressError):
        join_hint([], ["--model", "tiny"])
