"""The known-peers file beside the checkpoint: kept across runs, bounded, and never trusted."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dht.heartbeat import Heartbeat
from dht.known_peers import (
    MAX_FILE_BYTES,
    MAX_KNOWN_PEERS,
    PeersToDial,
    join_peers,
    known_peers_path,
    load_known_peers,
    peer_addresses,
    remember_peers,
    save_known_peers,
)

PEERS = [
    "12D3KooWGgtHxHyqJ2bBHB6YPBFu2yC7n1AVXsbuXrBjVt3jxY3E",
    "12D3KooWQYhTNQdmr3ArTeUHRYzFg94BKyTkoWBDWez9kSCVe2Xo",
    "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN",
]


def maddr(port: int, peer: str = PEERS[0]) -> str:
    return f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer}"


def beat(peer: str, sent_at: float, *maddrs: str) -> Heartbeat:
    return Heartbeat(peer_id=peer, round=1, sent_at=sent_at, maddrs=list(maddrs))


def test_saved_peers_come_back_in_order(tmp_path: Path) -> None:
    path = tmp_path / "known_peers.json"
    saved = save_known_peers(path, [maddr(1), maddr(2, PEERS[1]), maddr(1)])
    assert saved == [maddr(1), maddr(2, PEERS[1])]
    assert load_known_peers(path) == saved
    assert [p.name for p in tmp_path.iterdir()] == ["known_peers.json"]  # no temporary left


def test_a_missing_file_is_no_known_peers(tmp_path: Path) -> None:
    assert load_known_peers(tmp_path / "nothing.json") == []


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\xff\xfe garbage",
        b"[1, 2, 3]",
        b'{"version": 2, "peers": []}',
        b'{"version": 1}',
        b'{"version": 1, "peers": ["/ip4/127.0.0.1/tcp/1"]}',  # no /p2p part
        b'{"version": 1, "peers": ["not an address"]}',
        b'{"version": 1, "peers": [7]}',
        b'{"version": "1", "peers": []}',
        b'{"version": 1, "peers": [], "extra": true}',
        json.dumps(
            {"version": 1, "peers": [maddr(i) for i in range(MAX_KNOWN_PEERS + 1)]}
        ).encode(),
        b" " * (MAX_FILE_BYTES + 1),
    ],
)
def test_a_corrupt_file_is_ignored_with_one_line(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "known_peers.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="dht.known_peers"):
        assert load_known_peers(path) == []
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "\n" not in message and "ignoring known peers file" in message


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(max_size=512))
def test_any_bytes_at_all_never_crash_the_reader(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "known_peers.json"
    path.write_bytes(content)
    assert isinstance(load_known_peers(path), list)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.integers(1, 65535), max_size=3 * MAX_KNOWN_PEERS))
def test_the_file_stays_bounded_however_many_peers_were_seen(
    tmp_path: Path, ports: list[int]
) -> None:
    path = tmp_path / "known_peers.json"
    saved = save_known_peers(path, [maddr(p) for p in ports] + ["junk", "/ip4/1.2.3.4/tcp/5"])
    assert len(saved) == min(len(set(ports)), MAX_KNOWN_PEERS)
    assert path.stat().st_size <= MAX_FILE_BYTES
    assert load_known_peers(path) == saved


def test_remembered_peers_are_the_newest_heard_first_then_those_known_before(
    tmp_path: Path,
) -> None:
    save_known_peers(known_peers_path(tmp_path), [maddr(9, PEERS[2])])
    alive = [
        beat(PEERS[0], 10.0, "/ip4/127.0.0.1/tcp/1"),
        beat(PEERS[1], 20.0, maddr(2, PEERS[1])),
    ]
    remembered = remember_peers(tmp_path, alive)
    assert remembered == [maddr(2, PEERS[1]), maddr(1, PEERS[0]), maddr(9, PEERS[2])]
    assert remember_peers(tmp_path, []) == remembered  # seeing no one forgets no one


def test_an_address_naming_another_peer_is_not_taken_as_this_one() -> None:
    got = peer_addresses(PEERS[0], ["/ip4/10.0.0.1/tcp/1", maddr(2, PEERS[1]), maddr(3)])
    assert got == [maddr(1, PEERS[0]).replace("127.0.0.1", "10.0.0.1"), maddr(3)]


def test_an_unwritable_directory_costs_one_line_not_the_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="dht.known_peers"):
        assert remember_peers(blocker, [beat(PEERS[0], 1.0, maddr(1))]) == []
    assert any("could not write known peers" in r.getMessage() for r in caplog.records)


def _dead_port() -> int:
    with socket.socket() as sock:  # bound, never listening: a connection is refused
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_known_member_whose_peers_are_all_down_starts_alone_and_keeps_them(
    tmp_path: Path,
) -> None:
    """It tries once (no 90 s of retries before training): nobody answers, so the DHT starts
    alone and the bootstrap and known peers are dialled in the background."""
    bootstrap, known = maddr(_dead_port()), maddr(_dead_port(), PEERS[1])
    save_known_peers(known_peers_path(tmp_path), [known])
    started = time.monotonic()
    peers = join_peers([bootstrap], tmp_path, known_member=True)
    assert time.monotonic() - started < 5
    assert peers == PeersToDial(now=[], rejoin=[bootstrap, known])


def test_a_known_member_dials_who_answers_and_keeps_every_peer_for_later(tmp_path: Path) -> None:
    with socket.socket() as member:
        member.bind(("127.0.0.1", 0))
        member.listen()
        alive, dead = maddr(member.getsockname()[1]), maddr(_dead_port(), PEERS[1])
        peers = join_peers([dead, alive], tmp_path, known_member=True)
    assert peers == PeersToDial(now=[alive], rejoin=[dead, alive])


def test_a_newcomer_has_nothing_to_rejoin_with(tmp_path: Path) -> None:
    with socket.socket() as member:
        member.bind(("127.0.0.1", 0))
        member.listen()
        alive = maddr(member.getsockname()[1])
        assert join_peers([alive], tmp_path, known_member=False) == PeersToDial([alive], [])
    assert join_peers([], tmp_path, known_member=True) == PeersToDial([], [])
