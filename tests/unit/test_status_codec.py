"""`diloco-node status` shows what codec each peer sends with, whether `--codec auto` picked
it, and its measured uplink, from the peers' heartbeats; "?" for a peer that does not say (a
node of an earlier version)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from dht.heartbeat import Heartbeat, sign_fields
from dht.observer import PeerStatus, SwarmSnapshot
from dht.records import owner_subkey
from merge.identity import Identity
from node.status import bytes_label, codec_label, print_status
from tests.unit.test_membership_hold import membership

PEERS = [Identity.from_private_bytes(bytes([i + 1]) * 32) for i in range(3)]


def snapshot() -> list[SwarmSnapshot]:
    beats = [
        Heartbeat(peer_id=PEERS[0].peer_id, codec="topk", codec_auto=True,
                  uplink_bytes_per_s=625000.0),
        Heartbeat(peer_id=PEERS[1].peer_id, codec="int8", codec_auto=False),
        Heartbeat(peer_id=PEERS[2].peer_id),  # an earlier version's: none of the three
    ]  # fmt: skip
    verified = [Heartbeat.verify(b.sign(i), i.peer_id) for b, i in zip(beats, PEERS, strict=True)]
    return [SwarmSnapshot("run", "f" * 64, "{}", [PeerStatus(b, 1.0) for b in verified])]


def test_status_prints_each_peers_codec_and_uplink(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "250")
    print_status("run", snapshot(), as_json=False)
    out = capsys.readouterr().out
    assert "codec" in out
    lines = {peer.peer_id[-12:]: line for peer in PEERS for line in out.splitlines()
             if peer.peer_id[-12:] in line}  # fmt: skip
    assert "topk (auto) · 625.0 KB/s" in lines[PEERS[0].peer_id[-12:]]
    assert "int8 · ?" in lines[PEERS[1].peer_id[-12:]]
    assert "(auto)" not in lines[PEERS[1].peer_id[-12:]]
    assert " ? " in lines[PEERS[2].peer_id[-12:]]


def test_status_json_carries_the_three_fields_null_when_not_said(
    capsys: pytest.CaptureFixture[str],
) -> None:
    print_status("run", snapshot(), as_json=True)
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    rows = {p["peer_id"]: p for p in run["peers"]}
    fields = ("codec", "codec_auto", "uplink_bytes_per_s")
    assert [rows[PEERS[0].peer_id][f] for f in fields] == ["topk", True, 625000.0]
    assert [rows[PEERS[1].peer_id][f] for f in fields] == ["int8", False, None]
    assert [rows[PEERS[2].peer_id][f] for f in fields] == [None, None, None]


@pytest.mark.parametrize(
    ("codec", "auto", "uplink", "label"),
    [
        ("topk", True, 625000.0, "topk (auto) · 625.0 KB/s"),
        ("bf16", False, 1.25e8, "bf16 · 125.0 MB/s"),
        ("bf16", True, None, "bf16 (auto) · ?"),
        ("int8", None, 12.0, "int8 · 12 B/s"),
        (None, None, 999.0, "? · 999 B/s"),
        (None, None, None, "?"),
    ],
)
def test_the_codec_label(
    codec: str | None, auto: bool | None, uplink: float | None, label: str
) -> None:
    assert codec_label(codec, auto, uplink) == label


def test_bytes_are_labelled_in_decimal_units_as_the_dashboard_does() -> None:
    assert [bytes_label(x) for x in (0, 999, 1000, 1.5e6, 2e15)] == [
        "0 B", "999 B", "1.0 KB", "1.5 MB", "2000.0 TB",
    ]  # fmt: skip


@pytest.mark.parametrize(
    "changes",
    [{"codec": "<script>"}, {"codec": "x" * 17}, {"codec_auto": "yes"}, {"codec": ["topk"]}],
)
def test_a_hostile_codec_is_refused_and_counted_by_membership(changes: dict[str, object]) -> None:
    """Read as a peer's record arrives: refused, counted as heartbeat_malformed, never raised;
    the peer is not taken as alive on it."""
    fields = dataclasses.asdict(Heartbeat(peer_id=PEERS[0].peer_id, sent_at=1.0)) | changes
    blob = sign_fields(fields, PEERS[0])
    m = membership(PEERS[1], [{owner_subkey(PEERS[0].peer_id): blob}])
    assert asyncio.run(m.poll()) == [] and not m.is_alive(PEERS[0].peer_id)
    assert m._reject.counts == {"heartbeat_malformed": 1}  # type: ignore[attr-defined]
