"""The seq ledger: what an identity sealed survives a restart, per run, whatever the file holds."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node import seq_ledger
from node.seq_ledger import SeqLedger

RUN_A, RUN_B = "a" * 64, "b" * 64


def test_a_recorded_seq_is_read_back_by_a_fresh_ledger(tmp_path: Path) -> None:
    path = tmp_path / "id.key.seqs"
    SeqLedger(path, RUN_A).record(7)
    assert SeqLedger(path, RUN_A).last() == 7
    assert SeqLedger(path, RUN_B).last() == 0  # another run's seqs are its own
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_ledger_never_goes_back(tmp_path: Path) -> None:
    ledger = SeqLedger(tmp_path / "s", RUN_A)
    ledger.record(5)
    ledger.record(3)
    assert SeqLedger(tmp_path / "s", RUN_A).last() == 5


def test_runs_are_kept_apart_and_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seq_ledger, "MAX_RUNS", 4)
    path = tmp_path / "s"
    for i in range(seq_ledger.MAX_RUNS + 3):
        SeqLedger(path, f"{i:064x}").record(i + 1)
    SeqLedger(path, RUN_A).record(2)
    kept = json.loads(path.read_text())
    assert len(kept) == seq_ledger.MAX_RUNS and kept[RUN_A] == 2
    assert f"{0:064x}" not in kept  # the oldest went first


@pytest.mark.parametrize(
    "content", [b"", b"not json", b"[1, 2]", b'{"%s": "7"}' % RUN_A.encode(), b"\xff\xfe"]
)
def test_a_damaged_file_reads_as_empty_and_is_replaced(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "s"
    path.write_bytes(content)
    assert SeqLedger(path, RUN_A).last() == 0
    SeqLedger(path, RUN_A).record(4)
    assert SeqLedger(path, RUN_A).last() == 4


def test_bad_seqs_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="seq"):
        SeqLedger(tmp_path / "s", RUN_A).record(-1)


@settings(max_examples=20, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([RUN_A, RUN_B]), st.integers(0, 10**6)), max_size=6))
def test_last_is_the_max_recorded_per_run(tmp_path_factory, records) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path_factory.mktemp("ledger") / "s"
    for run, seq in records:
        SeqLedger(path, run).record(seq)
    for run in (RUN_A, RUN_B):
        expected = max((s for r, s in records if r == run), default=0)
        assert SeqLedger(path, run).last() == expected
