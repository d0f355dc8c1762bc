"""The tests' one factory of sealed updates: valid as a peer would send them, and the only one."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from merge.codecs import get_codec
from merge.envelope import SignedUpdate, verify
from merge.identity import Identity
from tests.factories import ALICE, FINGERPRINT, identity, sealed_update

TESTS = Path(__file__).resolve().parents[1]


def test_a_sealed_update_verifies_after_the_wire_and_decodes_to_its_delta() -> None:
    delta = torch.tensor([0.5, -0.25, 0.0, 1.0])
    update = sealed_update(ALICE, delta=delta, seq=4, published_applied=2, learners=3)

    parsed = SignedUpdate.from_bytes(update.to_bytes())

    verify(parsed)
    assert parsed.header.author == ALICE.peer_id and parsed.header.fingerprint == FINGERPRINT
    assert (parsed.header.seq, parsed.header.published_applied, parsed.header.learners) == (4, 2, 3)
    assert torch.equal(get_codec("fp32").decode(parsed.payload, 4), delta)


def test_defaults_give_the_same_bytes_each_time_and_none_stamps_the_time() -> None:
    assert sealed_update().to_bytes() == sealed_update().to_bytes()
    assert sealed_update(numel=8).header.numel == 8 == len(sealed_update(numel=8).payload) // 4
    assert sealed_update(created_at=None).header.created_at > 1.0e9


def test_identity_keeps_the_keys_tests_always_used() -> None:
    assert identity("a").peer_id == Identity.from_private_bytes(b"a" * 32).peer_id
    assert identity(bytes([7])).peer_id == Identity.from_private_bytes(bytes([7]) * 32).peer_id
    assert identity("sybil-1").peer_id != identity("sybil-2").peer_id


def test_no_test_seals_updates_its_own_way() -> None:
    sealing = re.compile(r"^from merge\.envelope import[^\n]*\bseal\b|\bseal\(", re.M)
    own_way = [
        path.relative_to(TESTS).as_posix()
        for path in TESTS.rglob("*.py")
        if path.name != "factories.py" and sealing.search(path.read_text())
    ]
    assert own_way == [], "build updates with tests.factories.sealed_update"
