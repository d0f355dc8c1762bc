"""Retained updates: a memory budget, spilling to disk beyond it, a per-author cap, cleanup."""

from __future__ import annotations

from pathlib import Path

from dht.retention import RetainedUpdates


def test_updates_beyond_the_memory_budget_spill_to_disk_and_read_back(tmp_path: Path) -> None:
    retained = RetainedUpdates(per_author=10, budget_bytes=250, spill_dir=tmp_path)
    blobs = {("a", seq): bytes([seq]) * 100 for seq in range(1, 5)}
    for uid, blob in blobs.items():
        retained.put(uid, blob)
    assert retained.memory_bytes <= 250 and retained.disk_bytes == 200
    assert {uid: retained.get(uid) for uid in blobs} == blobs
    assert len(list(tmp_path.glob("*/*.update"))) == 2


def test_only_the_last_updates_of_each_author_are_kept(tmp_path: Path) -> None:
    retained = RetainedUpdates(per_author=2, budget_bytes=0, spill_dir=tmp_path)
    for seq in (3, 1, 2):
        retained.put(("a", seq), b"x")
    retained.put(("b", 1), b"y")
    assert sorted(retained.ids()) == [("a", 2), ("a", 3), ("b", 1)]
    assert retained.get(("a", 1)) is None
    assert len(list(tmp_path.glob("*/*.update"))) == 3  # budget 0: everything on disk


def test_close_removes_the_spill_directory(tmp_path: Path) -> None:
    retained = RetainedUpdates(per_author=4, budget_bytes=0, spill_dir=tmp_path)
    retained.put(("../evil", 1), b"z")
    assert retained.get(("../evil", 1)) == b"z"
    retained.close()
    assert list(tmp_path.iterdir()) == [] and retained.ids() == []


def test_fresh_authors_hold_a_32nd_of_the_memory_budget_together(tmp_path: Path) -> None:
    """40 Sybil keys' updates filled the whole memory budget (bench.attack sybil_learners:
    +250 MB RSS); now fresh authors share a 32nd of it and the rest spill to disk, served
    all the same, and an established author's updates stay in memory."""
    retained = RetainedUpdates(per_author=16, budget_bytes=32_000, spill_dir=tmp_path)
    retained.is_fresh = lambda author: author.startswith("sybil")
    for seq in range(4):
        retained.put(("alice", seq), b"a" * 500)
    for seq in range(4):
        for key in range(40):
            retained.put((f"sybil{key}", seq), bytes([key]) * 100)
    assert retained.fresh_bytes <= 1_000
    assert retained.memory_bytes == 2_000 + retained.fresh_bytes  # alice: all in memory
    assert retained.get(("sybil0", 0)) == bytes([0]) * 100  # spilled, still served
    assert retained.memory_bytes + retained.disk_bytes == 2_000 + 160 * 100
    retained.close()
    assert retained.fresh_bytes == retained.memory_bytes == 0


def test_a_superseding_variant_replaces_the_bytes_held_and_a_withdrawn_one_goes(
    tmp_path: Path,
) -> None:
    """`put` keeps the first bytes under an id; `supersede` replaces them, in memory or on
    disk, with the accounting and the author's seqs kept right; None forgets the id."""
    for budget in (1000, 0):  # in memory, spilled to disk
        retained = RetainedUpdates(per_author=4, budget_bytes=budget, spill_dir=tmp_path)
        retained.put(("g", 3), b"lesser")
        retained.put(("g", 3), b"prevailing")
        assert retained.get(("g", 3)) == b"lesser"
        retained.supersede(("g", 3), b"prevailing")
        assert retained.get(("g", 3)) == b"prevailing" and retained.seqs("g") == [3]
        assert retained.memory_bytes + retained.disk_bytes == len(b"prevailing")
        retained.supersede(("g", 3), None)
        assert retained.get(("g", 3)) is None and ("g", 3) not in retained
        assert retained.seqs("g") == [] and retained.memory_bytes + retained.disk_bytes == 0
        retained.close()
